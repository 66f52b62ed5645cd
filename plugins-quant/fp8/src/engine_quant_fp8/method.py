"""``Fp8LinearMethod``: parameters, post-load quantization and the forward of one linear layer.

Whatever the source, after ``process_weights_after_loading`` every layer holds the same
thing: ``weight [out, in]`` float8_e4m3fn and ``weight_scale [out]`` float32 (one scale
per output channel), plus ``input_scale []`` for static activation checkpoints. One
layout means one forward path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from engine.layers.quantization import LinearMethodBase
from torch import nn

from engine_quant_fp8.gemm import fp8_linear
from engine_quant_fp8.quantize import FP8_DTYPE, quantize_per_channel

if TYPE_CHECKING:
    from engine_quant_fp8.config import Fp8Config


def _scale_loader(weight_loader: Any) -> Any:
    """Wraps the layer's loader so a scale stored as ``[]`` or ``[1]`` both fit a ``[1]`` slot."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        weight_loader(param, loaded.reshape(1) if loaded.numel() == 1 else loaded, shard_id)

    return load


def _replace(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    # A fresh Parameter (not .data surgery): dtype and shape change, loader attrs are done with.
    setattr(layer, name, nn.Parameter(value, requires_grad=False))


class Fp8LinearMethod(LinearMethodBase):
    """FP8 weights with per-output-channel scales; see ``engine_quant_fp8.gemm`` for the GEMM."""

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
        # One per-tensor scale per logical shard; no output_dim, so the fused layers'
        # loaders place shard i's scalar at index i.
        names = ["weight_scale"] + (["input_scale"] if self.config.activation_scheme == "static" else [])
        for name in names:
            scale = nn.Parameter(torch.empty(len(output_partition_sizes), dtype=torch.float32), requires_grad=False)
            scale.weight_loader = _scale_loader(weight_loader)
            layer.register_parameter(name, scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.checkpoint_serialized:
            weight, scale = quantize_per_channel(layer.weight.data)
            _replace(layer, "weight", weight)
            _replace(layer, "weight_scale", scale)
            return
        # Per-shard scalars become per-channel scales: shard i's scale repeated over its rows.
        # The fp8 values are left untouched, so this is exact (no requantization error).
        widths = torch.tensor(layer.logical_widths, device=layer.weight_scale.device)
        _replace(layer, "weight_scale", layer.weight_scale.data.float().repeat_interleave(widths))
        if self.config.activation_scheme == "static":
            # One activation scale feeds the fused GEMM; the largest never clips any shard's input.
            _replace(layer, "input_scale", layer.input_scale.data.float().max())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, getattr(layer, "input_scale", None))
