"""``route_and_align`` in one Triton launch: router, local ids and slot alignment (decode sizes).

One program holds the logits of every token (``[BLOCK_T, BLOCK_E]``), takes each row's float32
softmax top-k (``router_kernel._softmax_topk_rows``, the router kernel's own code, so weights and
ids come out as ``select_experts`` gives them on CUDA), writes the weights and the local ids
(global id minus ``expert_start``; ``-1`` outside this rank's ``num_local`` experts), and hands
the ``[BLOCK_T, BLOCK_K]`` slot tile (slot ``t * top_k + k``) to the alignment
(``align_kernel._align_slots_tile``), which writes the ``ExpertBlocks``. Nothing goes back to
memory in between: the separate launches' global round trips and launch gaps are what it saves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.moe.align_kernel import _align_slots_tile, align_tile_sizes, empty_expert_blocks
from engine.layers.moe.expert_blocks import ExpertBlocks
from engine.layers.moe.route_align_sizes import (
    ROUTE_ALIGN_MAX_LOGITS,
    ROUTE_ALIGN_MAX_SLOTS,
    route_align_fits,
)
from engine.layers.moe.router_kernel import _softmax_topk_rows


@triton.jit
def _route_align_kernel(
    logits_ptr, weights_ptr, ids_ptr, sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    tokens, num_experts, expert_start, num_local, stride_lt, stride_le, max_padded, num_blocks,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_BINS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_T)[:, None]
    offs_e = tl.arange(0, BLOCK_E)[None, :]
    in_range = offs_e < num_experts
    # Rows past the last token read zeros: a finite softmax whose picks are never stored.
    logits = tl.load(logits_ptr + rows.to(tl.int64) * stride_lt + offs_e * stride_le,
                     mask=(rows < tokens) & in_range, other=0.0).to(tl.float32)
    top_w, top_ids = _softmax_topk_rows(logits, in_range, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)

    offs_k = tl.arange(0, BLOCK_K)[None, :]
    slot_ok = (rows < tokens) & (offs_k < TOP_K)
    slots = rows * TOP_K + offs_k  # < BLOCK_T * BLOCK_K = BLOCK_S on every lane
    local = top_ids - expert_start
    held = (local >= 0) & (local < num_local)
    tl.store(weights_ptr + slots, top_w, mask=slot_ok)
    tl.store(ids_ptr + slots, tl.where(held, local, -1), mask=slot_ok)

    # Row-major flattening (can_reorder=False) for all three: a reordering reshape may order each
    # tensor's lanes its own way (their layouts differ), which paired slots with other slots' bins
    # on the H100 (8 tokens x top 8 of 8 experts: a token's slot twice, another's never).
    slot_bin = tl.reshape(tl.where(held, local, num_local), [BLOCK_S], can_reorder=False)
    slot_ids = tl.reshape(slots, [BLOCK_S], can_reorder=False)
    slot_ok = tl.reshape(slot_ok, [BLOCK_S], can_reorder=False)
    _align_slots_tile(slot_bin, slot_ids, slot_ok, tokens * TOP_K, num_local, max_padded, num_blocks,
                      sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
                      BLOCK_S, BLOCK_M, BLOCK_BINS, BLOCK_P, BLOCK_NB)


def route_and_align_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int,
                           expert_start: int = 0,
                           num_local_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks]:
    """``route_and_align`` in one launch: same arguments, same result (weights within float32
    rounding of the torch softmax, ids and blocks equal). Needs ``route_align_fits``. Runs
    wherever Triton does: CUDA, or CPU tensors under ``TRITON_INTERPRET=1``."""
    tokens, num_experts = router_logits.shape
    num_local = num_experts if num_local_experts is None else num_local_experts
    if not 0 < top_k <= num_experts:
        raise ValueError(f"route_and_align: top_k {top_k} out of range for {num_experts} experts; "
                         f"accepted: 1..{num_experts}")
    if not (0 <= expert_start and 0 < num_local and expert_start + num_local <= num_experts):
        raise ValueError(f"route_and_align: local experts [{expert_start}, {expert_start + num_local}) "
                         f"out of range for {num_experts} experts; accepted: a non-empty range inside [0, {num_experts})")
    if not route_align_fits(tokens, num_experts, top_k, block_m):
        raise ValueError(f"route_and_align_triton: {tokens} tokens x top {top_k} of {num_experts} experts with "
                         f"block_m {block_m}; accepted: 1..{ROUTE_ALIGN_MAX_SLOTS} slots, at most "
                         f"{ROUTE_ALIGN_MAX_LOGITS} logits (tokens and experts rounded up to powers of two) "
                         "and a power-of-two block_m")
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    blocks = empty_expert_blocks(tokens * top_k, num_local, block_m, device)
    sizes = align_tile_sizes(tokens * top_k, num_local, block_m)
    block_t, block_e, block_k = (triton.next_power_of_2(n) for n in (tokens, num_experts, top_k))
    sizes["BLOCK_S"] = block_t * block_k
    widest = max(block_t * block_e, sizes["BLOCK_S"], sizes["BLOCK_BINS"], sizes["BLOCK_P"])
    sizes["num_warps"] = 1 if widest <= 256 else 4 if widest <= 2048 else 8
    _route_align_kernel[(1,)](
        router_logits, weights, ids, blocks.sorted_slot_ids, blocks.block_expert_ids, blocks.num_padded,
        tokens, num_experts, expert_start, num_local, router_logits.stride(0), router_logits.stride(1),
        blocks.sorted_slot_ids.numel(), blocks.block_expert_ids.numel(),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, **sizes,
    )
    return weights, ids, blocks
