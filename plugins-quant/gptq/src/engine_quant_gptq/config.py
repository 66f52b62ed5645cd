"""``GptqConfig`` (a checkpoint's ``quantization_config``) and ``GptqLinearMethod``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from engine.errors import ModelLoadError
from engine.layers.quantization import LinearMethodBase, QuantizationConfig
from engine_quant_wna16.layout import check_group_size_field
from engine_quant_wna16.method import WNA16LinearMethod, resolve_group_size

from engine_quant_gptq.format import unpack_gptq

if TYPE_CHECKING:
    from engine_quant_wna16.layout import IntWeight
    from torch import nn

BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass
class GptqConfig(QuantizationConfig):
    """A GPTQ checkpoint (see ``engine_quant_gptq.format`` for the tensors)."""

    bits: int = 4
    #: input channels per group (-1: one group per output channel).
    group_size: int = 128
    #: act-order: ``g_idx`` scatters each group over the input channels.
    desc_act: bool = False
    #: symmetric: zero point ``2**(bits-1)``, ``qzeros`` not read.
    sym: bool = True
    #: ``gptq_v2`` stores zero points as is; ``gptq`` (v1) stores ``zero - 1``.
    checkpoint_format: str = "gptq"
    #: ``modules_to_not_convert``: layers the checkpoint keeps in 16-bit.
    ignored: tuple[str, ...] = ()

    name = "gptq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GptqConfig:
        if not config:
            raise ModelLoadError("--quant gptq loads GPTQ checkpoints only, and config.json has no "
                                 "quantization_config; quantize the model with GPTQModel/AutoGPTQ, "
                                 "or choose an on-the-fly method such as --quant fp8")
        method = config.get("quant_method", "gptq")
        if method != "gptq":
            raise ModelLoadError(f"plugserve-quant-gptq: quantization_config.quant_method is '{method}'; accepted: gptq")
        bits = config.get("bits", 4)
        if bits not in BITS:
            raise ModelLoadError(f"gptq quantization_config.bits: {bits} is not supported; accepted: 4, 8")
        group_size = config.get("group_size", 128)
        check_group_size_field(group_size, "gptq quantization_config.group_size", one_group="-1 (one group)")
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in CHECKPOINT_FORMATS:
            raise ModelLoadError(f"gptq quantization_config.checkpoint_format: '{fmt}' is not supported; "
                                 f"accepted: {', '.join(CHECKPOINT_FORMATS)}")
        if config.get("lm_head"):
            raise ModelLoadError("gptq quantization_config.lm_head: true (a quantized LM head) is not supported; "
                                 "accepted: false")
        if config.get("dynamic"):
            raise ModelLoadError("gptq quantization_config.dynamic (per-module overrides) is not supported; "
                                 "accepted: absent or empty")
        ignored = config.get("modules_to_not_convert") or ()
        return cls(bits=bits, group_size=group_size, desc_act=bool(config.get("desc_act", False)),
                   sym=bool(config.get("sym", True)), checkpoint_format=fmt, ignored=tuple(ignored))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return GptqLinearMethod(self)

    def supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    def ignored_layers(self) -> list[str]:
        return list(self.ignored)


class GptqLinearMethod(WNA16LinearMethod):
    """Loads ``qweight``/``qzeros``/``scales``/``g_idx`` as stored; repacked for the kernels after
    loading (act-order becomes a permutation of the kernel's rows, see ``engine_quant_wna16.layout``)."""

    format_name = "gptq"

    def __init__(self, config: GptqConfig) -> None:
        self.config = config

    def describe(self) -> str:
        c = self.config
        return f"bits={c.bits}, group_size={c.group_size}, desc_act={c.desc_act}"

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: Any) -> None:
        c = self.config
        per_word = 32 // c.bits
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if any(size % per_word for size in output_partition_sizes):
            raise ModelLoadError(f"gptq layer {layer.prefix}: output sizes {output_partition_sizes} are not "
                                 f"multiples of {per_word}, which GPTQ packs qzeros by")
        if k % per_word:
            raise ModelLoadError(f"gptq layer {layer.prefix}: input size {k} is not a multiple of {per_word}")
        row_split = input_size_per_partition != input_size
        if c.desc_act and row_split and c.group_size != -1:
            # A rank's slice of K holds members of any group; its groups are no longer whole.
            raise ModelLoadError(f"gptq desc_act: true with tensor parallelism splits act-order groups across ranks "
                                 f"in {layer.prefix}; accepted: --tp 1, or a checkpoint without desc_act")
        group = resolve_group_size(c.group_size, c.bits, layer, k, "gptq")
        layer.wna16_group = group
        split = {"input_dim": 0} if c.group_size != -1 else {}
        self.add_checkpoint_param(layer, "qweight", (k // per_word, n), torch.int32, weight_loader,
                                  input_dim=0, output_dim=1, packed_dim=0, packed_factor=per_word)
        self.add_checkpoint_param(layer, "qzeros", (k // group, n // per_word), torch.int32, weight_loader,
                                  output_dim=1, packed_dim=1, packed_factor=per_word, **split)
        self.add_checkpoint_param(layer, "scales", (k // group, n), torch.float16, weight_loader,
                                  output_dim=1, **split)
        # Plain groups until loaded, so --load-format dummy (which leaves int tensors alone) is valid.
        plain = (torch.arange(k) // group).to(torch.int32)
        self.add_per_shard_param(layer, "g_idx", (k,), torch.int32, len(output_partition_sizes), plain, input_dim=0)

    def read_checkpoint(self, layer: nn.Module) -> IntWeight:
        c = self.config
        g_idx = None
        if c.desc_act:
            g_idx = layer.g_idx.data[0]
            # q, k and v (gate and up) see the same input, so GPTQ orders their channels alike;
            # one fused weight can follow one order only.
            if not all(bool(torch.equal(g_idx, other)) for other in layer.g_idx.data[1:]):
                raise ModelLoadError(f"gptq layer {layer.prefix}: the fused projections' g_idx differ; one fused "
                                     "weight needs one input-channel order (act-order with a shared Hessian)")
        return unpack_gptq(layer.qweight.data, layer.qzeros.data, layer.scales.data, g_idx, c.bits,
                           layer.wna16_group, c.sym, c.checkpoint_format == "gptq_v2")
