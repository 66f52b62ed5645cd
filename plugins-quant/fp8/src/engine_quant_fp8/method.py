"""``Fp8LinearMethod``: parameters, post-load conversion and the forward of one linear layer.

Whatever the source, after ``process_weights_after_loading`` every layer holds
``weight [out, in]`` float8_e4m3fn and a float32 ``weight_scale``:

- ``[out]``, one scale per output channel: ``--quant fp8``, and checkpoints with per-tensor
  (``tensor``) or per-channel (``channel``) scales; plus ``input_scale []`` for static
  activation checkpoints;
- ``[ceil(out/bn), ceil(in/bk)]``, one scale per weight tile: block-wise checkpoints
  (``weight_block_size``), whatever name the checkpoint gave the tensor.

Two layouts, one forward (``engine_quant_fp8.gemm.fp8_linear``) that tells them apart by rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from engine.errors import ModelLoadError
from engine.layers.quantization import ActivationQuantizer, LinearMethodBase, QuantizedActivation
from torch import nn

from engine_quant_fp8.gemm import fp8_linear, fp8_linear_quantized
from engine_quant_fp8.quantize import FP8_DTYPE, quantize_per_channel

if TYPE_CHECKING:
    from engine_quant_fp8.config import Fp8Config


def _scale_loader(weight_loader: Any) -> Any:
    """Wraps the layer's loader so a scale stored as ``[]`` or ``[1]`` both fit a ``[1]`` slot."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        weight_loader(param, loaded.reshape(1) if loaded.numel() == 1 else loaded, shard_id)

    return load


def _channel_scale_loader(weight_loader: Any) -> Any:
    """Wraps the layer's loader so per-channel scales stored ``[out, 1]`` load into an ``[out]`` slot."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        weight_loader(param, loaded.reshape(-1), shard_id)

    return load


def _replace(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    # A fresh Parameter (not .data surgery): dtype and shape change, loader attrs are done with.
    if name in layer._parameters:
        delattr(layer, name)
    setattr(layer, name, nn.Parameter(value, requires_grad=False))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8LinearMethod(LinearMethodBase):
    """FP8 weights with per-channel or per-tile scales; see ``engine_quant_fp8.gemm`` for the GEMM."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: Any) -> None:
        # The logical widths (q/k/v, gate/up) turn per-shard scales into per-channel ones later.
        layer.logical_widths = list(output_partition_sizes)
        out_features = sum(output_partition_sizes)
        # On the fly the checkpoint's 16/32-bit weight loads as is and is quantized after loading.
        weight_dtype = FP8_DTYPE if self.config.checkpoint_serialized else params_dtype
        weight = nn.Parameter(torch.empty(out_features, input_size_per_partition, dtype=weight_dtype),
                              requires_grad=False)
        weight.input_dim, weight.output_dim, weight.weight_loader = 1, 0, weight_loader
        layer.register_parameter("weight", weight)
        if not self.config.checkpoint_serialized:
            return
        strategy = self.config.weight_strategy
        if strategy == "block":
            self._create_block_scale(layer, input_size_per_partition, input_size, output_partition_sizes, weight_loader)
            return
        if strategy == "channel":
            scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
            scale.output_dim, scale.weight_loader = 0, _channel_scale_loader(weight_loader)
            layer.register_parameter("weight_scale", scale)
        # tensor: one scale per logical shard; no output_dim, so the fused layers' loaders
        # place shard i's scalar at index i.
        names = (["weight_scale"] if strategy == "tensor" else []) + \
            (["input_scale"] if self.config.activation_scheme == "static" else [])
        for name in names:
            scale = nn.Parameter(torch.empty(len(output_partition_sizes), dtype=torch.float32), requires_grad=False)
            scale.weight_loader = _scale_loader(weight_loader)
            layer.register_parameter(name, scale)

    def _create_block_scale(self, layer: nn.Module, input_size_per_partition: int, input_size: int,
                            output_partition_sizes: list[int], weight_loader: Any) -> None:
        bn, bk = self.config.weight_block_size  # type: ignore[misc]
        prefix = getattr(layer, "prefix", "") or type(layer).__name__
        tp_size = getattr(layer, "tp_size", 1)
        rows_aligned = all(w % bn == 0 for w in output_partition_sizes)
        if len(output_partition_sizes) > 1 and not rows_aligned:
            raise ModelLoadError(f"fp8 weight_block_size [{bn}, {bk}]: the fused layer {prefix} stacks shards of "
                                 f"{output_partition_sizes} rows; block-wise scales need every shard's rows to be "
                                 f"a multiple of {bn}")
        if tp_size > 1 and (not rows_aligned or input_size_per_partition % bk):
            raise ModelLoadError(f"fp8 weight_block_size [{bn}, {bk}]: {prefix} splits into "
                                 f"{output_partition_sizes} x {input_size_per_partition} per rank at tensor "
                                 f"parallel size {tp_size}; each rank's rows and columns must be multiples of the block")
        out_features = sum(output_partition_sizes)
        scale = nn.Parameter(torch.empty(_cdiv(out_features, bn), _cdiv(input_size_per_partition, bk),
                                         dtype=torch.float32), requires_grad=False)
        scale.input_dim, scale.weight_loader = 1, weight_loader
        if rows_aligned:
            # Shards are whole row-blocks: the loaders place shard i's [rows/bn, :] scales at
            # its row offset / bn, the same arithmetic as a packed dim of factor bn.
            scale.output_dim, scale.packed_dim, scale.packed_factor = 0, 0, bn
        # else: one shard whose last row-block is partial; it loads whole (no output_dim).
        layer.register_parameter(self.config.block_scale_name, scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.checkpoint_serialized:
            weight, scale = quantize_per_channel(layer.weight.data)
            _replace(layer, "weight", weight)
            _replace(layer, "weight_scale", scale)
            return
        strategy = self.config.weight_strategy
        if strategy == "block":
            # The scale is already the dequantizing multiplier; only its name is unified.
            scale = getattr(layer, self.config.block_scale_name).data.float().contiguous()
            delattr(layer, self.config.block_scale_name)
            _replace(layer, "weight_scale", scale)
            return
        if strategy == "tensor":
            # Per-shard scalars become per-channel scales: shard i's scale repeated over its rows.
            # The fp8 values are left untouched, so this is exact (no requantization error).
            widths = torch.tensor(layer.logical_widths, device=layer.weight_scale.device)
            _replace(layer, "weight_scale", layer.weight_scale.data.float().repeat_interleave(widths))
        else:
            _replace(layer, "weight_scale", layer.weight_scale.data.float().contiguous())
        if self.config.activation_scheme == "static":
            # One activation scale feeds the fused GEMM; the largest never clips any shard's input.
            _replace(layer, "input_scale", layer.input_scale.data.float().max())

    def activation_quantizer(self, layer: nn.Module) -> ActivationQuantizer | None:
        # Per-channel weights with dynamic per-token activations: the producer (RMSNorm,
        # SiLU-and-mul) quantizes at the token counts where the fp8 x fp8 GEMM runs.
        if (not self.config.fuse_activation_quant or self.config.weight_strategy == "block"
                or getattr(layer, "input_scale", None) is not None or layer.weight.dtype != FP8_DTYPE):
            return None
        from engine_quant_fp8.fused import Fp8ActivationQuantizer

        return Fp8ActivationQuantizer()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            return fp8_linear_quantized(x, layer.weight, layer.weight_scale, bias, self.config.fast_accum)
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, getattr(layer, "input_scale", None),
                          self.config.weight_block_size, self.config.fast_accum)
