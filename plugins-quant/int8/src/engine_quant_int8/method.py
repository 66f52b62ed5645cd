"""``W8A8Int8LinearMethod``: parameters, post-load quantization and the forward of one linear layer.

After ``process_weights_after_loading`` every layer holds ``weight [out, in]`` int8 and
``weight_scale [out]`` float32, whether it came from a checkpoint or was quantized here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from engine.layers.quantization import LinearMethodBase
from torch import nn

from engine_quant_int8.gemm import w8a8_linear
from engine_quant_int8.quantize import quantize_per_channel

if TYPE_CHECKING:
    from engine_quant_int8.config import W8A8Int8Config


def _flat_scale_loader(weight_loader: Any) -> Any:
    """Wraps the layer's loader: checkpoints store ``[out, 1]`` (SGLang) or ``[out]``; we keep ``[out]``."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        weight_loader(param, loaded.reshape(-1), shard_id)

    return load


def _replace(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    # A fresh Parameter (not .data surgery): dtype and shape change, loader attrs are done with.
    setattr(layer, name, nn.Parameter(value, requires_grad=False))


class W8A8Int8LinearMethod(LinearMethodBase):
    """int8 x int8 -> int32 GEMM, rescaled by per-token and per-channel scales."""

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

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.config.checkpoint_serialized:
            return
        weight, scale = quantize_per_channel(layer.weight.data)
        _replace(layer, "weight", weight)
        _replace(layer, "weight_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return w8a8_linear(x, layer.weight, layer.weight_scale, bias)
