"""``AwqConfig`` (a checkpoint's ``quantization_config``) and ``AwqLinearMethod``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from engine.errors import ModelLoadError
from engine.layers.quantization import LinearMethodBase, QuantizationConfig
from engine_quant_wna16.layout import check_group_size_field
from engine_quant_wna16.method import WNA16LinearMethod, resolve_group_size

from engine_quant_awq.format import BITS, unpack_awq

if TYPE_CHECKING:
    from engine_quant_wna16.layout import IntWeight
    from torch import nn


@dataclass
class AwqConfig(QuantizationConfig):
    """An AutoAWQ GEMM checkpoint: 4-bit asymmetric weights in groups of ``group_size`` inputs."""

    #: input channels per scale/zero group (-1: one group per output channel).
    group_size: int = 128
    #: ``modules_to_not_convert``: layers the checkpoint keeps in 16-bit.
    ignored: tuple[str, ...] = ()

    name = "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AwqConfig:
        """From ``quantization_config`` (Hugging Face's keys, or AutoAWQ's ``w_bit``/``q_group_size``)."""
        if not config:
            raise ModelLoadError("--quant awq loads AWQ checkpoints only, and config.json has no "
                                 "quantization_config; quantize the model with AutoAWQ (or llm-compressor), "
                                 "or choose an on-the-fly method such as --quant fp8")
        method = config.get("quant_method", "awq")
        if method != "awq":
            raise ModelLoadError(f"plugserve-quant-awq: quantization_config.quant_method is '{method}'; accepted: awq")
        bits = config.get("bits", config.get("w_bit", BITS))
        if bits != BITS:
            raise ModelLoadError(f"awq quantization_config.bits: {bits} is not supported; accepted: 4")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"awq quantization_config.version: '{version}' is not supported; accepted: gemm "
                                 "(AutoAWQ's GEMM layout; re-save GEMV/Marlin/ExLlama checkpoints as GEMM)")
        if not config.get("zero_point", True):
            raise ModelLoadError("awq quantization_config.zero_point: false is not supported; accepted: true")
        group_size = config.get("group_size", config.get("q_group_size", 128))
        check_group_size_field(group_size, "awq quantization_config.group_size", one_group="-1")
        ignored = config.get("modules_to_not_convert") or ()
        return cls(group_size=group_size, ignored=tuple(ignored))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return AwqLinearMethod(self)

    def supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    def ignored_layers(self) -> list[str]:
        return list(self.ignored)


class AwqLinearMethod(WNA16LinearMethod):
    """Loads ``qweight``/``qzeros``/``scales`` as stored; repacked for the kernels after loading."""

    format_name = "awq"

    def __init__(self, config: AwqConfig) -> None:
        self.config = config

    def describe(self) -> str:
        return f"bits=4, group_size={self.config.group_size}"

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: Any) -> None:
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if any(size % 8 for size in output_partition_sizes):
            raise ModelLoadError(f"awq layer {layer.prefix}: output sizes {output_partition_sizes} are not "
                                 "multiples of 8, which AWQ packs along the output dim")
        group = resolve_group_size(self.config.group_size, BITS, layer, k, "awq")
        layer.wna16_group = group
        # One group per output channel is not split with the input (every rank has all of K's group).
        split = {"input_dim": 0} if self.config.group_size != -1 else {}
        packed = {"output_dim": 1, "packed_dim": 1, "packed_factor": 8}
        self.add_checkpoint_param(layer, "qweight", (k, n // 8), torch.int32, weight_loader,
                                  input_dim=0, **packed)
        self.add_checkpoint_param(layer, "qzeros", (k // group, n // 8), torch.int32, weight_loader,
                                  **split, **packed)
        self.add_checkpoint_param(layer, "scales", (k // group, n), torch.float16, weight_loader,
                                  output_dim=1, **split)

    def read_checkpoint(self, layer: nn.Module) -> IntWeight:
        return unpack_awq(layer.qweight.data, layer.qzeros.data, layer.scales.data, layer.wna16_group)
