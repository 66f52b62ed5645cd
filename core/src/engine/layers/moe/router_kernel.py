"""Softmax top-k routing in one Triton launch (what ``select_experts`` runs on CUDA).

The torch version is four or five launches (softmax, topk, the renormalising sum and division,
the int32 cast); at batch 1 each costs more than the work it does. Here program ``t`` loads
token ``t``'s ``E`` logits, takes the float32 softmax, picks the ``top_k`` largest by repeated
arg-max and writes them, optionally renormalised, highest first.

Ties: of equal probabilities the lower expert id is taken first (``torch.topk`` leaves the
order of equal values unspecified, so both agree wherever the torch result is defined).
Selection is on the float32 probabilities, as in the torch version, not on the logits.

The same helpers route inside the fused router+alignment launch (``route_align_kernel``) and the
small-batch expert launches (``_slot_expert``, ``_token_routing``, for
``small_batch.fused_moe_small_batch_routed``), and all give the same bits whatever their number
of warps and register layout: the softmax's denominator is an exact integer sum
(``_softmax_probs``), a round is a maximum and a minimum (``_take_best``), and the renormalising
sum adds the weights in slot order. So a kernel that recomputes the routing agrees with this one,
and two kernels that each recompute it agree with each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Units of the softmax's denominator, fixed point: 2**-40 (see ``_softmax_probs``), kept as two
#: int32 halves of 2**20 units each.
_HALF_ONE: tl.constexpr = tl.constexpr(2.0**20)


@triton.jit
def _softmax_probs(logits, in_range):
    """Float32 softmax of each row of a ``[rows, BLOCK_E]`` float32 tile (``in_range``: the lanes
    that are experts); the other lanes get -1, below every probability.

    The denominator adds the numerators (each in (0, 1]) truncated to multiples of 2**-40, exactly,
    in integers: integers add to the same total in any order, so every kernel that routes (this
    one, ``route_align_kernel``'s, the small-batch expert kernels', each with its own number of
    warps and register layout) gets the same bits, where a float32 sum's bits depend on the
    reduction tree. The truncation costs at most ``E * 2**-40`` of a sum that is at least 1 (the
    largest numerator is exp(0)): far below the float32 rounding of the sum itself. Each numerator
    ``n`` is split exactly into ``hi = trunc(n * 2**20)`` and ``lo = trunc(frac(n * 2**20) * 2**20)``
    and each half summed in int32 (no overflow up to 2047 experts; a warp adds int32 in one
    instruction, ``redux.sync``), then ``hi * 2**20 + lo`` in int64. Past 1024 lanes the int64
    units are summed directly: the same integers, so the same total."""
    shifted = logits - tl.max(tl.where(in_range, logits, -float("inf")), axis=1)[:, None]
    numer = tl.where(in_range, tl.exp(shifted), 0.0)
    scaled = numer * _HALF_ONE  # exact: a power of two
    if logits.shape[1] <= 1024:
        hi = scaled.to(tl.int32)
        lo = ((scaled - hi.to(tl.float32)) * _HALF_ONE).to(tl.int32)  # the fraction is exact too
        fixed = tl.sum(hi, axis=1).to(tl.int64) * (1 << 20) + tl.sum(lo, axis=1)
    else:
        fixed = tl.sum((scaled * _HALF_ONE).to(tl.int64), axis=1)
    denom = fixed.to(tl.float32) * (1.0 / (_HALF_ONE * _HALF_ONE))
    return tl.where(in_range, numer / denom[:, None], -1.0)


@triton.jit
def _take_best(probs, ids):
    """One arg-max round over each row of ``probs`` (``ids``: each lane's expert id, same shape):
    ``(best [rows], best_id [rows], probs with that lane taken)``. Of equal probabilities the lower
    id. A maximum and a minimum are exact in any reduction order: every layout gets these bits.

    The probabilities are compared as their int32 bit patterns: for floats >= +0 (a softmax has no
    -0) and the -1 of taken lanes (negative as an int too) that order is the float order, and a
    warp reduces 32-bit integers in one instruction (``redux.sync``, sm_80+) where a float maximum
    takes five shuffles. (Two reductions, not one over (probability, id) pairs: that one has no
    single instruction, and in Triton's interpreter its combine runs element by element.)"""
    bits = probs.to(tl.int32, bitcast=True)
    best_bits = tl.max(bits, axis=1)
    best_id = tl.min(tl.where(bits == best_bits[:, None], ids, probs.shape[1]), axis=1)
    return best_bits.to(tl.float32, bitcast=True), best_id, tl.where(ids == best_id[:, None], -1.0, probs)


@triton.jit
def _softmax_topk_rows(logits, in_range, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Softmax top-k of each row of a ``[rows, BLOCK_E]`` float32 tile (``in_range``: the lanes
    that are experts) -> ``(weights, ids)``, ``[rows, BLOCK_K]``, the first ``TOP_K`` columns
    used, highest weight first. Shared with the fused router (``route_align_kernel``); the
    small-batch expert kernels run the same rounds (``_slot_expert``, ``_token_routing``)."""
    probs = _softmax_probs(logits, in_range)
    ids = tl.broadcast_to(tl.arange(0, BLOCK_E)[None, :], probs.shape)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    top_w = tl.zeros((logits.shape[0], BLOCK_K), dtype=tl.float32)
    top_ids = tl.zeros((logits.shape[0], BLOCK_K), dtype=tl.int32)
    # The renormalising sum in slot order, one addition a round: the same bits in every kernel.
    total = tl.zeros((logits.shape[0],), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best, best_id, probs = _take_best(probs, ids)
        top_w = tl.where(offs_k == k, best[:, None], top_w)
        top_ids = tl.where(offs_k == k, best_id[:, None], top_ids)
        total += best
    if RENORMALIZE:
        top_w = top_w / total[:, None]
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


# The routing of one token inside the small-batch expert kernels (``small_batch``'s routed launches),
# which route for themselves instead of reading a top-k launch's output.


@triton.jit
def _token_probs(logits_ptr, token, num_experts, stride_lt, stride_le,
                 ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    """``(probs, ids)``: ``_softmax_probs`` of token ``token``'s logits as ``[ROWS, BLOCK_E]`` rows
    that are all the same, and each lane's expert id. With ``ROWS`` the launch's number of warps,
    Triton lays the tile out one row per warp, so every reduction of the rounds stays inside a warp
    (shuffles; no shared memory, no barrier); any other ``ROWS`` is as correct, only slower."""
    rows = tl.arange(0, ROWS)[:, None]
    offs_e = tl.arange(0, BLOCK_E)[None, :]
    in_range = (offs_e < num_experts) & (rows >= 0)
    ptrs = logits_ptr + token.to(tl.int64) * stride_lt + rows * 0 + offs_e * stride_le
    logits = tl.load(ptrs, mask=in_range, other=0.0).to(tl.float32)
    return _softmax_probs(logits, in_range), tl.broadcast_to(offs_e, (ROWS, BLOCK_E))


@triton.jit
def _slot_expert(logits_ptr, token, k, num_experts, stride_lt, stride_le, expert_start, num_local,
                 ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    """The expert of slot ``k`` of token ``token`` (``select_experts``' ``ids[token, k]``, bit for
    bit): ``k + 1`` arg-max rounds, the weight not needed. Returns a scalar local id, ``-1`` when
    the expert is outside ``[expert_start, expert_start + num_local)`` (another expert-parallel
    rank's)."""
    probs, ids = _token_probs(logits_ptr, token, num_experts, stride_lt, stride_le, ROWS, BLOCK_E)
    best_id = tl.zeros((ROWS,), dtype=tl.int32)
    rounds_left = k  # a loop of k + 1 rounds, run-time k (a while: the interpreter takes no range(tensor))
    while rounds_left >= 0:
        _, best_id, probs = _take_best(probs, ids)
        rounds_left -= 1
    local = tl.max(best_id, axis=0) - expert_start  # the rows agree: any reduction gives their id
    return tl.where((local >= 0) & (local < num_local), local, -1)


@triton.jit
def _token_routing(logits_ptr, token, num_experts, stride_lt, stride_le, expert_start, num_local,
                   TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_TK: tl.constexpr):
    """Token ``token``'s routing, ``select_experts`` + ``to_local_expert_ids`` bit for bit:
    ``(experts, weights)``, ``[BLOCK_TK]`` (lane ``k`` < ``TOP_K``: slot ``k``), local ids with
    ``-1`` (and weight 0) for another rank's experts and for lanes past ``TOP_K``."""
    probs, ids = _token_probs(logits_ptr, token, num_experts, stride_lt, stride_le, ROWS, BLOCK_E)
    offs_t = tl.arange(0, BLOCK_TK)[None, :]
    top_w = tl.zeros((ROWS, BLOCK_TK), dtype=tl.float32)
    top_ids = tl.zeros((ROWS, BLOCK_TK), dtype=tl.int32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # as _softmax_topk_rows
        best, best_id, probs = _take_best(probs, ids)
        top_w = tl.where(offs_t == k, best[:, None], top_w)
        top_ids = tl.where(offs_t == k, best_id[:, None], top_ids)
        total += best
    if RENORMALIZE:
        top_w = top_w / total[:, None]
    local = tl.max(top_ids, axis=0) - expert_start
    held = (tl.arange(0, BLOCK_TK) < TOP_K) & (local >= 0) & (local < num_local)
    return tl.where(held, local, -1), tl.where(held, tl.max(top_w, axis=0), 0.0)
