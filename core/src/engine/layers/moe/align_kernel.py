"""``align_slots_by_expert`` in one Triton launch, for decode-sized batches.

The torch version is about thirty small launches (counting, two cumulative sums, a stable sort,
gathers, a scatter, a binary search); at batch 1 they cost several times the expert GEMMs. Here a
single program does it all in registers, in three passes over the slots and blocks:

1. **Count** the slots of each bin (``E`` experts, then bin ``E``: experts held elsewhere), a
   chunk of ``CHUNK`` slots at a time (a ``[CHUNK, bins]`` one-hot summed over the slots).
2. **Scan**: each bin's run padded to a multiple of ``BLOCK_M``; exclusive cumulative sum ->
   where each run starts; the total is ``num_padded``.
3. **Scatter** the slots in ascending order, chunk by chunk: a slot goes to its bin's start, plus
   the slots of that bin in earlier chunks (a running count per bin), plus those earlier in its
   own chunk (a ``[CHUNK, CHUNK]`` comparison). So each run lists its slots in ascending id,
   as the stable sort of the torch version does.
4. **Blocks**: for every block, its bin (how many runs end at or before its first entry, the
   torch version's ``searchsorted``), its expert (``-1`` for bin ``E`` and past the end), and the
   entries after the bin's real slots, which get the padding value ``num_slots``.

Passes 3 and 4 write disjoint entries of ``sorted_slot_ids`` (real slots, padding), so no
barrier is needed between them. The output sizes follow from the batch shape alone, as in the
torch version: a decode step that uses it can be captured in a CUDA graph. The work grows with
``slots * bins``, hence the cap ``align.ALIGN_KERNEL_MAX_SLOTS`` above which ``align_slots_by_expert``
keeps the torch version (prefill, where a few dozen launches do not matter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.moe.align import ALIGN_KERNEL_MAX_SLOTS, ExpertBlocks, kernel_can_align, max_padded_slots


@triton.jit
def _slot_bins(ids_ptr, offs, num_slots, num_experts, BLOCK_BINS: tl.constexpr):
    """The bin of each slot ``offs``: its expert, ``num_experts`` for one held elsewhere (``-1``),
    ``BLOCK_BINS`` (no bin) past the last slot."""
    ok = offs < num_slots
    ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    slot_bin = tl.where((ids < 0) | (ids >= num_experts), num_experts, ids)
    return tl.where(ok, slot_bin, BLOCK_BINS)


@triton.jit
def _align_slots_kernel(
    ids_ptr, sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    num_slots, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_BINS: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr,
):
    bins = tl.arange(0, BLOCK_BINS)
    is_bin = bins <= num_experts  # lanes past bin E (padding up to a power of two) stay empty
    chunk = tl.arange(0, CHUNK)

    # 1. Count per bin. Slots past the end get bin BLOCK_BINS, which matches no lane.
    counts = tl.zeros((BLOCK_BINS,), dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        slot_bin = _slot_bins(ids_ptr, start + chunk, num_slots, num_experts, BLOCK_BINS)
        counts += tl.sum((slot_bin[:, None] == bins[None, :]).to(tl.int32), axis=0)

    # 2. Padded runs and where they start.
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_ends = tl.cumsum(padded, axis=0)
    run_starts = run_ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)

    # 3. Scatter the slots, stable within each bin.
    next_free = run_starts
    for start in range(0, num_slots, CHUNK):
        offs = start + chunk
        slot_bin = _slot_bins(ids_ptr, offs, num_slots, num_experts, BLOCK_BINS)
        onehot = slot_bin[:, None] == bins[None, :]
        base = tl.sum(tl.where(onehot, next_free[None, :], 0), axis=1)
        earlier_same = (slot_bin[:, None] == slot_bin[None, :]) & (chunk[None, :] < chunk[:, None])
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)
        tl.store(sorted_slot_ids_ptr + base + rank, offs, mask=offs < num_slots)
        next_free += tl.sum(onehot.to(tl.int32), axis=0)

    # 4. Each block's expert, and the padding after each run's slots.
    real_ends = run_starts + counts
    in_block = tl.arange(0, BLOCK_M)
    for bstart in range(0, num_blocks, BLOCKS_CHUNK):
        blk = bstart + tl.arange(0, BLOCKS_CHUNK)
        blk_ok = blk < num_blocks
        first = blk * BLOCK_M
        pos = first[:, None] + in_block[None, :]
        if bstart * BLOCK_M < total:
            blk_bin = tl.sum(((run_ends[None, :] <= first[:, None]) & is_bin[None, :]).to(tl.int32), axis=1)
            expert = tl.where(blk_bin < num_experts, blk_bin, -1)
            tl.store(block_expert_ids_ptr + blk, expert, mask=blk_ok)
            # Past every run, blk_bin is E + 1: a lane whose run is empty and starts at the total
            # (or no lane at all, giving 0); either way the whole block is padding.
            valid_end = tl.sum(tl.where(blk_bin[:, None] == bins[None, :], real_ends[None, :], 0), axis=1)
            pad = (pos >= valid_end[:, None]) & blk_ok[:, None]
            tl.store(sorted_slot_ids_ptr + pos, tl.zeros_like(pos) + num_slots, mask=pad)
        else:
            tl.store(block_expert_ids_ptr + blk, tl.zeros_like(blk) - 1, mask=blk_ok)
            tl.store(sorted_slot_ids_ptr + pos, tl.zeros_like(pos) + num_slots, mask=blk_ok[:, None])


def align_slots_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """``align_slots_by_expert`` in one launch: the same ``ExpertBlocks``, entry for entry.

    Ids outside ``0 .. num_experts - 1`` (``-1``: held elsewhere) all go to the "elsewhere"
    group. Needs ``kernel_can_align(tokens * top_k, block_m)``. Runs wherever Triton does: CUDA,
    or CPU tensors under ``TRITON_INTERPRET=1``.
    """
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_slots = flat.numel()
    if not kernel_can_align(num_slots, block_m):
        raise ValueError(f"align_slots_triton: {num_slots} slots with block_m {block_m}; accepted: "
                         f"1..{ALIGN_KERNEL_MAX_SLOTS} slots and a power-of-two block_m")
    max_padded = max_padded_slots(num_slots, num_experts, block_m)
    num_blocks = max_padded // block_m
    device = topk_ids.device
    sorted_slot_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_bins = triton.next_power_of_2(num_experts + 1)
    # [CHUNK, bins] one-hots of at most 32K entries: no stack use on sm_90 up to 511 experts (16 B at 1023).
    chunk = min(64, triton.next_power_of_2(num_slots), max(16, 32768 // block_bins))
    _align_slots_kernel[(1,)](
        flat, sorted_slot_ids, block_expert_ids, num_padded, num_slots, num_experts, num_blocks,
        BLOCK_M=block_m, BLOCK_BINS=block_bins, CHUNK=chunk, BLOCKS_CHUNK=32,
        num_warps=4 if block_bins <= 256 else 8,
    )
    return ExpertBlocks(sorted_slot_ids, block_expert_ids, num_padded, num_slots, block_m)
