"""The gated feed-forward block of Llama-style decoders: ``down(act(gate(x)) * up(x))``.

Llama, Mistral and Qwen layers, the dense layers and shared experts of the MoE and DeepSeek
models all build this one module. Its submodule names are the checkpoints' (``gate_up_proj``
loads ``gate_proj`` and ``up_proj`` as shards 0 and 1, ``down_proj``) and the ones
``activation_consumers`` declarations refer to (``mlp.act_fn`` -> ``mlp.down_proj``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.activation import get_act_and_mul
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from engine.layers.quantization import QuantizationConfig


class GatedMLP(nn.Module):
    """Gate and up projections in one column-parallel linear, the gated activation, and the
    row-parallel down projection.

    Under tensor parallelism each rank holds ``intermediate_size / tp`` columns; the down
    projection all-reduces its partial sums unless ``reduce_results=False`` (a caller summing
    several partial results before one all-reduce, as DeepSeek's routed plus shared experts).
    Both linears take their method from ``quant_config``; the activation is
    ``get_act_and_mul(hidden_act)``, which takes the platform's fused kernel where there is one.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 bias: bool = False, reduce_results: bool = True) -> None:
        super().__init__()
        at = f"{prefix}." if prefix else ""  # the layer names quant configs match (ignored layers)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{at}gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results,
                                           quant_config=quant_config, prefix=f"{at}down_proj")
        self.act_fn = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
