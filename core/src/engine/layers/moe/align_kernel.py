"""``align_slots_by_expert`` in one Triton launch, for decode-sized batches.

The torch version is about thirty small launches (counting, two cumulative sums, a stable sort,
gathers, a scatter, a binary search); at batch 1 they cost several times the expert GEMMs. Here a
single program does it all on one tile of slots, with no loop over slots or experts:

1. **Padding first**: every entry of ``sorted_slot_ids`` gets the padding value ``num_slots`` and
   every block the expert ``-1``; the real slots overwrite their entries in step 4 (after a
   barrier, so within the program the later store wins).
2. **Count** the slots of each bin (``E`` experts, then bin ``E``: experts held elsewhere) with one
   histogram; each bin's run padded to a multiple of ``BLOCK_M``; the total is ``num_padded``.
3. **Sort** the slots by ``(bin, slot)`` (one bitonic sort of ``bin * BLOCK_S + slot``): sorted
   position ``i`` holds the slot that goes to entry ``i + pads_before[bin]``, where
   ``pads_before`` is the exclusive cumulative sum of the padding of the earlier bins (the sorted
   position is the bin's start among the unpadded runs plus the slot's rank in its bin). Slots
   keep ascending id within a bin, as the stable sort of the torch version does.
4. **Scatter**: each slot to its entry, and its bin's expert (``-1`` for bin ``E``) to the block
   of that entry (every block of a run holds at least one real slot; the slots of one block
   write the same value).

``_align_slots_tile`` is shared with the fused router (``route_align_kernel``), which hands it
the bins straight from its top-k. The output sizes follow from the batch shape alone, as in the
torch version: a decode step that uses it can be captured in a CUDA graph. The tile holds every
slot, hence the cap ``align.ALIGN_KERNEL_MAX_SLOTS`` above which ``align_slots_by_expert`` keeps
the torch version (prefill, where a few dozen launches do not matter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.moe.align import (
    ALIGN_KERNEL_MAX_SLOTS,
    ExpertBlocks,
    kernel_can_align,
    max_padded_slots,
)


@triton.jit
def _align_slots_tile(
    slot_bin, slot_ids, slot_ok, num_slots, num_experts, max_padded, num_blocks,
    sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_BINS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    """Writes the ``ExpertBlocks`` of ``[BLOCK_S]`` lanes: ``slot_bin`` (``0 .. num_experts``, the
    last: held elsewhere), ``slot_ids`` (``< BLOCK_S``), ``slot_ok`` (the lane is a real slot)."""
    # 1. Padding everywhere; the real slots overwrite their entries after the barrier below.
    pos = tl.arange(0, BLOCK_P)
    tl.store(sorted_slot_ids_ptr + pos, tl.zeros_like(pos) + num_slots, mask=pos < max_padded)
    blk = tl.arange(0, BLOCK_NB)
    tl.store(block_expert_ids_ptr + blk, tl.zeros_like(blk) - 1, mask=blk < num_blocks)

    # 2. Slots per bin, padded runs, the padding before each bin.
    # Lanes that are no slot land in bin 0 and are taken off it again (no reliance on the mask
    # argument of tl.histogram, which not every Triton lowering has).
    bins = tl.arange(0, BLOCK_BINS)
    not_slots = BLOCK_S - tl.sum(slot_ok.to(tl.int32), axis=0)
    counts = tl.histogram(tl.where(slot_ok, slot_bin, 0), BLOCK_BINS).to(tl.int32)
    counts = counts - tl.where(bins == 0, not_slots, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    pads = padded - counts
    pads_before = tl.cumsum(pads, axis=0) - pads

    # 3. Sorted by (bin, slot); lanes that are no slot sort last (bin BLOCK_BINS).
    keys = tl.where(slot_ok, slot_bin, BLOCK_BINS) * BLOCK_S + slot_ids
    ordered = tl.sort(keys)
    ordered_bin = ordered // BLOCK_S
    ordered_ok = ordered_bin < BLOCK_BINS
    ordered_bin = tl.where(ordered_ok, ordered_bin, 0)
    dest = tl.arange(0, BLOCK_S) + tl.gather(pads_before, ordered_bin, 0)

    # 4. Scatter over the padding written in step 1.
    tl.debug_barrier()
    tl.store(sorted_slot_ids_ptr + dest, ordered % BLOCK_S, mask=ordered_ok)
    expert = tl.where(ordered_bin < num_experts, ordered_bin, -1)
    tl.store(block_expert_ids_ptr + dest // BLOCK_M, expert, mask=ordered_ok)


@triton.jit
def _align_slots_kernel(
    ids_ptr, sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    num_slots, num_experts, max_padded, num_blocks,
    BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_BINS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    slots = tl.arange(0, BLOCK_S)
    ok = slots < num_slots
    ids = tl.load(ids_ptr + slots, mask=ok, other=0).to(tl.int32)
    slot_bin = tl.where((ids < 0) | (ids >= num_experts), num_experts, ids)
    _align_slots_tile(slot_bin, slots, ok, num_slots, num_experts, max_padded, num_blocks,
                      sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
                      BLOCK_S, BLOCK_M, BLOCK_BINS, BLOCK_P, BLOCK_NB)


def align_tile_sizes(num_slots: int, num_experts: int, block_m: int) -> dict[str, int]:
    """The tile constants of ``_align_slots_tile`` and the warps for a batch (shared with the fused
    router): one lane per slot, per bin, per entry and per block."""
    max_padded = max_padded_slots(num_slots, num_experts, block_m)
    sizes = {"BLOCK_S": triton.next_power_of_2(num_slots), "BLOCK_M": block_m,
             "BLOCK_BINS": triton.next_power_of_2(num_experts + 1),
             "BLOCK_P": triton.next_power_of_2(max_padded),
             "BLOCK_NB": triton.next_power_of_2(max_padded // block_m)}
    widest = max(sizes["BLOCK_S"], sizes["BLOCK_BINS"], sizes["BLOCK_P"])
    # One warp keeps the scans, the histogram and the sort inside a warp at decode (8 slots,
    # 129 bins); more once a lane count would need more than 8 registers a thread.
    sizes["num_warps"] = 1 if widest <= 256 else 4 if widest <= 2048 else 8
    return sizes


def empty_expert_blocks(num_slots: int, num_experts: int, block_m: int, device: torch.device) -> ExpertBlocks:
    """The ``ExpertBlocks`` tensors, uninitialised, at the sizes ``max_padded_slots`` gives."""
    max_padded = max_padded_slots(num_slots, num_experts, block_m)
    return ExpertBlocks(torch.empty(max_padded, dtype=torch.int32, device=device),
                        torch.empty(max_padded // block_m, dtype=torch.int32, device=device),
                        torch.empty(1, dtype=torch.int32, device=device), num_slots, block_m)


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
    blocks = empty_expert_blocks(num_slots, num_experts, block_m, topk_ids.device)
    sizes = align_tile_sizes(num_slots, num_experts, block_m)
    _align_slots_kernel[(1,)](
        flat, blocks.sorted_slot_ids, blocks.block_expert_ids, blocks.num_padded,
        num_slots, num_experts, blocks.sorted_slot_ids.numel(), blocks.block_expert_ids.numel(), **sizes,
    )
    return blocks
