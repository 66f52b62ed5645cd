"""FP8 experts for ``engine.layers.moe.FusedMoE`` (``--quant fp8`` on a 16/32-bit MoE checkpoint).

The experts load in the model dtype, as the unquantized method's; after loading each expert's
``w13`` and ``w2`` are quantized to float8_e4m3fn with one scale per expert and output channel
(``w13_weight_scale [E, 2I]``, ``w2_weight_scale [E, H]``). On CUDA the fused MoE Triton kernel
reads the codes, converts them to the activation dtype as it loads them and applies the scales to
its accumulators (weight-only FP8: the expert bytes a decode step reads are halved); elsewhere the
torch reference dequantizes them. Activations stay 16-bit. The router (``gate``) is not an
expert and stays unquantized (the model builds it without a quant config).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.moe import UnquantizedFusedMoEMethod, fused_moe_reference
from engine.layers.moe.router import triton_available
from engine.layers.quantization import FusedMoEMethodBase
from engine_quant_fp8.quantize import quantize_per_channel


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> ``(codes [E, N, K] float8_e4m3fn, scales [E, N] float32)``: one scale per
    expert and output row, each row's absolute maximum on the top of the format."""
    experts, rows, cols = w.shape
    q, scale = quantize_per_channel(w.reshape(experts * rows, cols))
    return q.view(experts, rows, cols), scale.view(experts, rows)


class Fp8MoEMethod(FusedMoEMethodBase):
    """Per-expert, per-output-channel FP8 expert weights, quantized after loading."""

    #: routing and alignment in one launch (``FusedMoE``), the blocks handed to the kernel.
    takes_expert_blocks = True

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        # The checkpoint is 16/32-bit: load as the unquantized method does, quantize afterwards.
        UnquantizedFusedMoEMethod().create_weights(layer, num_experts, hidden_size,
                                                   intermediate_size_per_partition, params_dtype, weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13_weight", "w2_weight"):
            q, scale = quantize_experts(getattr(layer, name).data)
            delattr(layer, name)
            layer.register_parameter(name, nn.Parameter(q, requires_grad=False))
            layer.register_parameter(f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        args = (x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        scales = {"w13_scale": layer.w13_weight_scale, "w2_scale": layer.w2_weight_scale}
        if triton_available(x):
            from engine.layers.moe.fused_moe import fused_moe

            return fused_moe(*args, **scales, act_fn=getattr(layer, "act_fn", None),
                             blocks=getattr(layer, "expert_blocks", None), pdl=getattr(layer, "pdl", False))
        return fused_moe_reference(*args, **scales)
