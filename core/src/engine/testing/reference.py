"""Float64 reference implementations the conformance kit compares against."""

from __future__ import annotations

import torch


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                        scale: float, sliding_window: int = -1, logit_cap: float = 0.0) -> torch.Tensor:
    """Causal attention of one row in float64.

    q: ``[Lq, H, D]`` at absolute ``q_positions``; k/v: ``[Lk, Hkv, D]`` for positions ``0..Lk-1``.
    Returns ``[Lq, H, Dv]`` in float64.
    """
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    k_pos = torch.arange(k.shape[0], device=q.device)
    mask = k_pos[None, :] <= q_positions[:, None]
    if sliding_window > 0:
        mask &= k_pos[None, :] > q_positions[:, None] - sliding_window
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vd)
