"""``W8A8Int8LinearMethod``: parameters, post-load quantization and the forward of one linear layer.

After ``process_weights_after_loading`` every layer holds ``weight [out, in]`` int8 and
``weight_scale [out]`` float32, whether it came from a checkpoint or was quantized here, plus
``input_scale [1]`` float32 for static-activation checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from engine.layers.quantization import LinearMethodBase
from torch import nn

from engine_quant_int8.gemm import int8_linear
from engine_quant_int8.quantize import quantize_per_channel

if TYPE_CHECKING:
    from engine_quant_int8.config import W8A8Int8Config


def _flat_scale_loader(weight_loader: Any) -> Any:
    """Wraps the layer's loader: checkpoints store ``[out, 1]`` (SGLang) or ``[out]``; we keep ``[out]``."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        weight_loader(param, loaded.reshape(-1), shard_id)

    return load


def _input_scale_loader(weight_loader: Any) -> Any:
    """Wraps the layer's loader so a per-projection input scale stored as ``[]`` or ``[1]`` fits its slot."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        weight_loader(param, loaded.reshape(1), shard_id)

    return load


def _replace(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    # A fresh Parameter (not .data surgery): dtype and shape change, loader attrs are done with.
    setattr(layer, name, nn.Parameter(value, requires_grad=False))


class W8A8Int8LinearMethod(LinearMethodBase):
    """int8 weights; the forward is ``gemm.int8_linear`` (weight-only at small M, W8A8 above)."""

    def __init__(self, config: W8A8Int8Config) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: Any) -> None:
        out_features = sum(output_partition_sizes)
        # On the fly the checkpoint's 16/32-bit weight loads as is and is quantized after loading.
        weight_dtype = torch.int8 if self.config.checkpoint_serialized else params_dtype
        weight = nn.Parameter(torch.empty(out_features, input_size_per_partition, dtype=weight_dtype),
                              requires_grad=False)
        weight.input_dim, weight.output_dim, weight.weight_loader = 1, 0, weight_loader
        layer.register_parameter("weight", weight)
        if self.config.checkpoint_serialized:
            # Per-channel scales run along the output dim, so fused shards and TP slices
            # are placed exactly like the weight's rows.
            scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
            scale.output_dim, scale.weight_loader = 0, _flat_scale_loader(weight_loader)
            layer.register_parameter("weight_scale", scale)
        if self.config.activation_scheme == "static":
            # One scalar per logical shard (q/k/v, gate/up); no output_dim, so the fused layers'
            # loaders place shard i's scalar at index i.
            scale = nn.Parameter(torch.empty(len(output_partition_sizes), dtype=torch.float32),
                                 requires_grad=False)
            scale.weight_loader = _input_scale_loader(weight_loader)
            layer.register_parameter("input_scale", scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.config.activation_scheme == "static":
            # One activation scale feeds the fused GEMM; the largest never clips any shard's input.
            # Kept as a one-element tensor: the kernel reads it on the device (no host sync).
            _replace(layer, "input_scale", layer.input_scale.data.float().max().reshape(1))
        if self.config.checkpoint_serialized:
            return
        weight, scale = quantize_per_channel(layer.weight.data)
        _replace(layer, "weight", weight)
        _replace(layer, "weight_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias, getattr(layer, "input_scale", None))
