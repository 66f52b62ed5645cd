"""Sorting a batch's (token, expert) pairs by expert, in blocks the grouped GEMM can take.

Each token routed to ``top_k`` experts gives ``top_k`` *slots* (``slot = token * top_k + k``).
The fused kernel multiplies ``BLOCK_M`` slots at a time by one expert's weights, so the slots are
sorted by expert and each expert's run is padded up to a multiple of ``BLOCK_M`` with the
out-of-range slot id ``num_slots``: every block then belongs to exactly one expert.

Written with torch operations of fixed output size only (no ``nonzero``, no ``.item()``, no
data-dependent shapes): the sizes follow from the batch shape alone, so a decode step that uses
it can be captured in a CUDA graph. The slots of experts another expert-parallel rank holds
(id ``-1``) are gathered into blocks of their own whose expert is ``-1``: the kernel writes
zeros there.

On CUDA, batches of up to ``ALIGN_KERNEL_MAX_SLOTS`` slots (decode) take one Triton launch
instead, larger ones three (``engine.layers.moe.align_kernel``; the same result entry for entry);
the torch operations below stay for the CPU and as the kernels' test oracle.
"""

from __future__ import annotations

import torch

from engine.layers.moe.expert_blocks import (
    ALIGN_KERNEL_MAX_SLOTS,
    ExpertBlocks,
    chunks_can_align,
    kernel_can_align,
    max_padded_slots,
)
from engine.layers.moe.router import triton_available

# ALIGN_KERNEL_MAX_SLOTS and ExpertBlocks are re-exported: callers know them from this module.
__all__ = [
    "ALIGN_KERNEL_MAX_SLOTS",
    "ExpertBlocks",
    "align_slots_by_expert",
    "align_slots_reference",
    "chunks_can_align",
    "kernel_can_align",
    "max_padded_slots",
]


def align_slots_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Groups the slots of ``topk_ids`` (``[tokens, top_k]``, local expert ids or ``-1``) by expert.

    Args:
        topk_ids: expert of each slot, ``0 .. num_experts - 1`` or ``-1`` (held elsewhere).
        num_experts: experts on this rank.
        block_m: slots per block of the grouped GEMM.
    """
    if triton_available(topk_ids) and chunks_can_align(topk_ids.numel(), block_m):
        from engine.layers.moe.align_kernel import align_slots_chunked, align_slots_triton

        if kernel_can_align(topk_ids.numel(), block_m):
            return align_slots_triton(topk_ids, num_experts, block_m)
        return align_slots_chunked(topk_ids, num_experts, block_m)
    return align_slots_reference(topk_ids, num_experts, block_m)


def align_slots_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """``align_slots_by_expert`` in torch operations of fixed output size."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    # Bin num_experts collects the slots of experts held elsewhere.
    bins = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bins, torch.ones_like(bins))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    count_starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(bins, stable=True)
    sorted_bins = bins[order]
    rank_in_bin = torch.arange(num_slots, device=device) - count_starts[sorted_bins]
    dest = padded_starts[sorted_bins] + rank_in_bin
    max_padded = max_padded_slots(num_slots, num_experts, block_m)
    sorted_slot_ids = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    sorted_slot_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_bin = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert_ids = torch.where(block_bin < num_experts, block_bin, torch.full_like(block_bin, -1)).to(torch.int32)
    return ExpertBlocks(sorted_slot_ids, block_expert_ids, padded_ends[-1:].to(torch.int32), num_slots, block_m)
