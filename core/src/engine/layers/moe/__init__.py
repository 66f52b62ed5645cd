"""Mixture-of-experts layers of the layer SDK (docs/moe.md).

``FusedMoE`` (the layer), ``select_experts`` (softmax top-k routing), ``GroupedTopK`` /
``grouped_topk`` (DeepSeek's grouped routing), ``fused_moe_reference``
(the torch computation, run on the CPU) and, on CUDA, ``engine.layers.moe.fused_moe.fused_moe``
(the Triton kernel; imported only where it runs, so this package does not import triton).
"""

from __future__ import annotations

from engine.layers.moe.layer import FusedMoE, UnquantizedFusedMoEMethod, expert_params_mapping
from engine.layers.moe.reference import fused_moe_reference
from engine.layers.moe.router import select_experts
from engine.layers.moe.router_grouped import GroupedTopK, grouped_topk

__all__ = ["FusedMoE", "GroupedTopK", "UnquantizedFusedMoEMethod", "expert_params_mapping", "fused_moe_reference",
           "grouped_topk", "select_experts"]
