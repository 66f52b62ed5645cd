"""Grouped top-k routing in one Triton launch (what ``grouped_topk`` runs on CUDA).

The torch version is a dozen launches or more (float cast, softmax or sigmoid, the bias add, the
group view and its max or top-2 sum, the group top-k, the eligibility scatter and mask, the expert
top-k, the gather, renormalisation and scaling, the int32 cast); at decode batches each costs
more than its work. Here program ``t`` holds token ``t``'s ``E`` logits as a
``[groups, experts per group]`` tile and does all of it in registers: scores, the choice values
(scores plus the correction bias), group scores, the ``topk_groups`` best groups by repeated
arg-max, then the ``top_k`` best eligible experts the same way, writing their unbiased scores
(renormalised, scaled) and ids, best first.

Ties (equal group scores, equal choice values): the lower group or expert id wins; ``torch.topk``
leaves their order unspecified, so both agree wherever the torch result is defined.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    stride_lt, stride_le, scaling,
    GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr, TOP2: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    LIMIT_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_p = tl.arange(0, BLOCK_P)
    expert = offs_g[:, None] * PER_GROUP + offs_p[None, :]
    valid = (offs_g[:, None] < GROUPS) & (offs_p[None, :] < PER_GROUP)
    x = tl.load(logits_ptr + token * stride_lt + expert * stride_le, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        shifted = x - tl.max(tl.max(tl.where(valid, x, -float("inf")), axis=1), axis=0)
        numer = tl.where(valid, tl.exp(shifted), 0.0)
        scores = numer / tl.sum(tl.sum(numer, axis=1), axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, -float("inf"))

    if LIMIT_GROUPS:
        best = tl.max(choice, axis=1)
        if TOP2:
            # A group's two best: its maximum plus the maximum of the other lanes (the lowest
            # lane holding the maximum is the one left out, so a tie counts twice, as topk's).
            first = tl.min(tl.where(choice == best[:, None], offs_p[None, :], BLOCK_P), axis=1)
            best = best + tl.max(tl.where(offs_p[None, :] == first[:, None], -float("inf"), choice), axis=1)
        group_score = tl.where(offs_g < GROUPS, best, -float("inf"))
        keep = offs_g < 0
        for _ in tl.static_range(TOPK_GROUPS):
            top = tl.max(group_score, axis=0)
            top_g = tl.min(tl.where(group_score == top, offs_g, BLOCK_G), axis=0)
            keep = keep | (offs_g == top_g)
            group_score = tl.where(offs_g == top_g, -float("inf"), group_score)
        choice = tl.where(keep[:, None], choice, -float("inf"))

    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    big = BLOCK_G * BLOCK_P * 2
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        top_e = tl.min(tl.min(tl.where(choice == top, expert, big), axis=1), axis=0)
        w = tl.sum(tl.sum(tl.where(expert == top_e, scores, 0.0), axis=1), axis=0)
        top_w = tl.where(offs_k == k, w, top_w)
        top_ids = tl.where(offs_k == k, top_e, top_ids)
        choice = tl.where(expert == top_e, -float("inf"), choice)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(tl.where(offs_k < TOP_K, top_w, 0.0), axis=0) + 1e-20)
    top_w = top_w * scaling
    out_ok = offs_k < TOP_K
    tl.store(weights_ptr + token * TOP_K + offs_k, top_w, mask=out_ok)
    tl.store(ids_ptr + token * TOP_K + offs_k, top_ids, mask=out_ok)


def grouped_topk_triton(router_logits: torch.Tensor, top_k: int, routing: Any,
                        correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``grouped_topk`` in one launch: same arguments and result (ties: see the module docstring).
    Runs wherever Triton does: CUDA, or CPU tensors under ``TRITON_INTERPRET=1``. ``routing`` is a
    ``router_grouped.GroupedTopK`` (not imported here: that module imports this one)."""
    tokens, num_experts = router_logits.shape
    routing.check_experts(num_experts, top_k)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    groups = routing.num_groups
    per_group = num_experts // groups
    block_g, block_p = triton.next_power_of_2(groups), triton.next_power_of_2(per_group)
    _grouped_topk_kernel[(tokens,)](
        router_logits, correction_bias if correction_bias is not None else router_logits, weights, ids,
        router_logits.stride(0), router_logits.stride(1), float(routing.scaling_factor),
        GROUPS=groups, PER_GROUP=per_group, TOPK_GROUPS=routing.topk_groups, TOP_K=top_k,
        SIGMOID=routing.scoring == "sigmoid", TOP2=routing.group_score == "top2_sum",
        HAS_BIAS=correction_bias is not None, RENORMALIZE=routing.renormalize,
        LIMIT_GROUPS=groups > 1 and routing.topk_groups < groups,
        BLOCK_G=block_g, BLOCK_P=block_p, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1 if block_g * block_p <= 128 else 4,
    )
    return weights, ids
