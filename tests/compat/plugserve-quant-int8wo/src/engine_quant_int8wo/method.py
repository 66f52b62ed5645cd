"""int8 weight-only linear layers: the float weight is loaded as usual, then rounded to int8 with
one scale per output row; ``apply`` multiplies by the dequantized weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import set_weight_attrs
from engine.layers.quantization import LinearMethodBase, QuantizationConfig


class Int8WeightOnlyConfig(QuantizationConfig):
    name = "int8wo"

    @classmethod
    def from_config(cls, config):  # type: ignore[no-untyped-def]
        return cls()

    def get_linear_method(self, layer, prefix):  # type: ignore[no-untyped-def]
        return Int8WeightOnlyLinearMethod()


class Int8WeightOnlyLinearMethod(LinearMethodBase):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,  # type: ignore[no-untyped-def]
                       output_size, params_dtype, weight_loader):
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer):  # type: ignore[no-untyped-def]
        weight = layer.weight.data.float()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
        codes = torch.round(weight / scale).clamp(-127, 127).to(torch.int8)
        dtype = layer.weight.dtype
        del layer.weight
        layer.register_parameter("weight", nn.Parameter(codes, requires_grad=False))
        layer.register_parameter("weight_scale", nn.Parameter(scale.to(dtype), requires_grad=False))

    def apply(self, layer, x, bias=None):  # type: ignore[no-untyped-def]
        return F.linear(x, layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype), bias)
