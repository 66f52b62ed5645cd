"""Softmax top-k routing in one Triton launch (what ``select_experts`` runs on CUDA).

The torch version is four or five launches (softmax, topk, the renormalising sum and division,
the int32 cast); at batch 1 each costs more than the work it does. Here program ``t`` loads
token ``t``'s ``E`` logits, takes the float32 softmax, picks the ``top_k`` largest by repeated
arg-max and writes them, optionally renormalised, highest first.

Ties: of equal probabilities the lower expert id is taken first (``torch.topk`` leaves the
order of equal values unspecified, so both agree wherever the torch result is defined).
Selection is on the float32 probabilities, as in the torch version, not on the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_rows(logits, in_range, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Softmax top-k of each row of a ``[rows, BLOCK_E]`` float32 tile (``in_range``: the lanes
    that are experts) -> ``(weights, ids)``, ``[rows, BLOCK_K]``, the first ``TOP_K`` columns
    used, highest weight first. Shared with the fused router (``route_align_kernel``)."""
    shifted = logits - tl.max(tl.where(in_range, logits, -float("inf")), axis=1)[:, None]
    numer = tl.where(in_range, tl.exp(shifted), 0.0)
    probs = numer / tl.sum(numer, axis=1)[:, None]
    # Taken (and padding) lanes drop to -1, below every probability.
    probs = tl.where(in_range, probs, -1.0)

    offs_e = tl.arange(0, BLOCK_E)[None, :]
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    top_w = tl.zeros((logits.shape[0], BLOCK_K), dtype=tl.float32)
    top_ids = tl.zeros((logits.shape[0], BLOCK_K), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        # The maximum over the probabilities' int32 bit patterns: for floats >= +0 (a softmax has
        # no -0) and the -1 of taken lanes (negative as an int too) that order is the float order,
        # and a warp reduces 32-bit integers in one instruction (redux.sync, sm_80+) where a float
        # maximum takes five shuffles. The same lane wins, so the same bits come out.
        bits = probs.to(tl.int32, bitcast=True)
        best_bits = tl.max(bits, axis=1)[:, None]
        best = best_bits.to(tl.float32, bitcast=True)
        # The lowest id among the lanes holding the maximum: ties go to the lower expert.
        best_id = tl.min(tl.where(bits == best_bits, offs_e, BLOCK_E), axis=1)[:, None]
        top_w = tl.where(offs_k == k, best, top_w)
        top_ids = tl.where(offs_k == k, best_id, top_ids)
        probs = tl.where(offs_e == best_id, -1.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(offs_k < TOP_K, top_w, 0.0), axis=1)[:, None]
    return top_w, top_ids


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    num_experts, stride_lt, stride_le,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        # Launched with PDL: wait for the router's logits, then let the next kernel (the experts'
        # gate/up, launched with PDL too) take SM slots; it waits for these results in turn.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)[None, :]
    in_range = offs_e < num_experts
    logits = tl.load(logits_ptr + token * stride_lt + offs_e * stride_le, mask=in_range, other=0.0).to(tl.float32)
    top_w, top_ids = _softmax_topk_rows(logits, in_range, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    out_ok = offs_k < TOP_K
    tl.store(weights_ptr + token * TOP_K + offs_k, top_w, mask=out_ok)
    tl.store(ids_ptr + token * TOP_K + offs_k, top_ids, mask=out_ok)


def select_experts_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                          pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts`` in one launch: same arguments, same result (see the module docstring for
    ties). Runs wherever Triton does: CUDA, or CPU tensors under ``TRITON_INTERPRET=1``.
    ``pdl`` (sm_90+ only): as ``select_experts``'s."""
    tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"select_experts: top_k {top_k} out of range for {num_experts} experts; "
                         f"accepted: 1..{num_experts}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    _softmax_topk_kernel[(tokens,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0), router_logits.stride(1),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), PDL=pdl,
        num_warps=1 if block_e <= 128 else 4 if block_e <= 1024 else 8, launch_pdl=pdl,
    )
    return weights, ids
