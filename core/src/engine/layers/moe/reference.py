"""The torch reference of the fused MoE computation: one expert at a time.

It is what the CPU runs, what the Triton kernel is tested against, and the "per-expert loop"
the kernel benchmark compares with. Each expert gathers the tokens routed to it, runs its
SwiGLU MLP on them in the activation dtype (as transformers does), and adds the result, scaled
by the routing weight, into the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``w`` ([E, N, K]) in ``dtype``; with ``scale`` ([E, N], one per expert and output channel)
    its codes multiplied by it."""
    if scale is None:
        return w.to(dtype)
    return (w.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for every token ``t``.

    Args:
        x: ``[tokens, hidden]`` activations.
        w13: ``[E, 2 * I, hidden]``: each expert's gate rows then up rows.
        w2: ``[E, hidden, I]``: each expert's down projection.
        topk_weights: ``[tokens, top_k]`` routing weights.
        topk_ids: ``[tokens, top_k]`` ids into ``w13``/``w2``; ``-1`` (an expert another
            expert-parallel rank holds) contributes nothing.
        w13_scale, w2_scale: per expert, per output channel scales when the weights are
            quantized codes (fp8); None for plain weights.

    Returns:
        ``[tokens, hidden]`` in ``x``'s dtype.
    """
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for expert in torch.unique(topk_ids).tolist():
        if expert < 0:
            continue
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate_up = x[tokens] @ dequantize_experts(w13[expert:expert + 1], None if w13_scale is None
                                                 else w13_scale[expert:expert + 1], x.dtype)[0].t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = act @ dequantize_experts(w2[expert:expert + 1], None if w2_scale is None
                                        else w2_scale[expert:expert + 1], x.dtype)[0].t()
        out.index_add_(0, tokens, down * topk_weights[tokens, slots, None].to(x.dtype))
    return out
