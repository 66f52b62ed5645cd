"""``align_slots_by_expert`` in Triton: one launch for decode-sized batches, three for larger ones.

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
slot, hence the cap ``align.ALIGN_KERNEL_MAX_SLOTS``; above it ``align_slots_chunked`` (below)
does the same in three launches over chunks of slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.moe.expert_blocks import (
    ALIGN_KERNEL_MAX_SLOTS,
    ExpertBlocks,
    chunks_can_align,
    kernel_can_align,
    max_padded_slots,
)


@triton.jit
def _bin_counts(slot_bin, slot_ok, BLOCK_S: tl.constexpr, BLOCK_BINS: tl.constexpr):
    """Slots per bin of ``[BLOCK_S]`` lanes (``slot_ok``: the lane is a real slot). Lanes that are no
    slot land in bin 0 and are taken off it again (no reliance on the mask argument of
    tl.histogram, which not every Triton lowering has)."""
    bins = tl.arange(0, BLOCK_BINS)
    not_slots = BLOCK_S - tl.sum(slot_ok.to(tl.int32), axis=0)
    counts = tl.histogram(tl.where(slot_ok, slot_bin, 0), BLOCK_BINS).to(tl.int32)
    return counts - tl.where(bins == 0, not_slots, 0)


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
    counts = _bin_counts(slot_bin, slot_ok, BLOCK_S, BLOCK_BINS)
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


# --- Batches of any size (prefill): three launches over chunks of slots -------------------------
#
# Above ``ALIGN_KERNEL_MAX_SLOTS`` one tile cannot hold every slot, and the torch version is about
# thirty launches a layer: at a prefill of one prompt, bound by the host's launch overhead, those
# cost more than the GEMMs they feed. Here the slots are cut into chunks of ``CHUNK``:
#
# 1. ``_chunk_count_kernel``, a program a chunk: the chunk's slots per bin (one histogram), and
#    its share of the padding value written over ``sorted_slot_ids``.
# 2. ``_chunk_offsets_kernel``, one program: for every (chunk, bin) the slots of that bin in the
#    earlier chunks (a running sum down the chunks, written over the counts), each bin's padded run
#    and start, ``num_padded``, and each block's expert (the bins whose run ends at or before the
#    block's start, counted: what ``searchsorted(..., right=True)`` gives the torch version).
# 3. ``_chunk_scatter_kernel``, a program a chunk: the chunk's slots sorted by ``(bin, slot)``, so a
#    slot's rank among the chunk's slots of its bin is its sorted position less the chunk's slots of
#    lower bins; it goes to its bin's start + the earlier chunks' slots of its bin + that rank.
#
# Chunk order then slot order within a chunk is ascending slot id within every bin, as the
# stable sort of the torch version: the same entries, entry for entry. No host sync and output
# sizes from the batch shape alone, as before.

#: Slots a chunk (a program of the count and scatter launches).
ALIGN_CHUNK = 1024


@triton.jit
def _chunk_bins(ids_ptr, chunk, num_slots, num_experts, CHUNK: tl.constexpr):
    """The chunk's slot ids, whether each lane is a slot, and each slot's bin (``num_experts``:
    held elsewhere)."""
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = slots < num_slots
    ids = tl.load(ids_ptr + slots, mask=ok, other=0).to(tl.int32)
    return slots, ok, tl.where((ids < 0) | (ids >= num_experts), num_experts, ids)


@triton.jit
def _chunk_count_kernel(ids_ptr, counts_ptr, sorted_slot_ids_ptr, num_slots, num_experts, max_padded,
                        CHUNK: tl.constexpr, BLOCK_BINS: tl.constexpr, FILL_STEPS: tl.constexpr):
    chunk = tl.program_id(0)
    slots, ok, slot_bin = _chunk_bins(ids_ptr, chunk, num_slots, num_experts, CHUNK)
    tl.store(counts_ptr + chunk * BLOCK_BINS + tl.arange(0, BLOCK_BINS), _bin_counts(slot_bin, ok, CHUNK, BLOCK_BINS))
    # Padding over this chunk's share of the entries; the scatter launch overwrites the real ones.
    lanes = tl.arange(0, CHUNK)
    for step in range(FILL_STEPS):
        pos = (chunk * FILL_STEPS + step) * CHUNK + lanes
        tl.store(sorted_slot_ids_ptr + pos, tl.zeros_like(pos) + num_slots, mask=pos < max_padded)


@triton.jit
def _chunk_offsets_kernel(counts_ptr, starts_ptr, block_expert_ids_ptr, num_padded_ptr,
                          num_chunks, num_experts, num_blocks,
                          BLOCK_M: tl.constexpr, BLOCK_BINS: tl.constexpr, ROWS: tl.constexpr,
                          BLOCK_NB: tl.constexpr, CHUNK_TILES: tl.constexpr, BLOCK_TILES: tl.constexpr):
    bins = tl.arange(0, BLOCK_BINS)
    rows = tl.arange(0, ROWS)
    before = tl.zeros([BLOCK_BINS], dtype=tl.int32)
    for t in range(CHUNK_TILES):
        r = t * ROWS + rows
        ptrs = counts_ptr + r[:, None] * BLOCK_BINS + bins[None, :]
        tile = tl.load(ptrs, mask=(r < num_chunks)[:, None], other=0)
        # Each chunk's slots of each bin in all earlier chunks.
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + before[None, :], mask=(r < num_chunks)[:, None])
        before += tl.sum(tile, axis=0)
    padded = (before + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # bins past num_experts hold no slot: 0
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + bins, ends - padded)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    in_use = bins <= num_experts
    blk = tl.arange(0, BLOCK_NB)
    for t in range(BLOCK_TILES):
        b = t * BLOCK_NB + blk
        bin_of = tl.sum((((b * BLOCK_M)[:, None] >= ends[None, :]) & in_use[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ids_ptr + b, tl.where(bin_of < num_experts, bin_of, -1), mask=b < num_blocks)


@triton.jit
def _chunk_scatter_kernel(ids_ptr, counts_ptr, starts_ptr, sorted_slot_ids_ptr, num_slots, num_experts,
                          CHUNK: tl.constexpr, BLOCK_BINS: tl.constexpr):
    chunk = tl.program_id(0)
    slots, ok, slot_bin = _chunk_bins(ids_ptr, chunk, num_slots, num_experts, CHUNK)
    lanes = tl.arange(0, CHUNK)
    counts = _bin_counts(slot_bin, ok, CHUNK, BLOCK_BINS)
    lower = tl.cumsum(counts, axis=0) - counts  # the chunk's slots of lower bins
    # Lanes that are no slot sort last (bin BLOCK_BINS).
    ordered = tl.sort(tl.where(ok, slot_bin, BLOCK_BINS) * CHUNK + lanes)
    ordered_bin = ordered // CHUNK
    ordered_ok = ordered_bin < BLOCK_BINS
    ordered_bin = tl.where(ordered_ok, ordered_bin, 0)
    rank = lanes - tl.gather(lower, ordered_bin, 0)
    base = tl.load(starts_ptr + ordered_bin) + tl.load(counts_ptr + chunk * BLOCK_BINS + ordered_bin)
    tl.store(sorted_slot_ids_ptr + base + rank, chunk * CHUNK + ordered % CHUNK, mask=ordered_ok)


def align_slots_chunked(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                        chunk: int = ALIGN_CHUNK) -> ExpertBlocks:
    """``align_slots_by_expert`` for a batch of any size in three launches over chunks of
    ``chunk`` slots (a power of two; tests pass small ones): the same ``ExpertBlocks``, entry for
    entry. ``block_m`` a power of two. Runs wherever Triton does."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_slots = flat.numel()
    if not chunks_can_align(num_slots, block_m) or chunk <= 0 or chunk & (chunk - 1):
        raise ValueError(f"align_slots_chunked: {num_slots} slots, block_m {block_m}, chunk {chunk}; accepted: "
                         "at least one slot, a power-of-two block_m and chunk")
    device = topk_ids.device
    blocks = empty_expert_blocks(num_slots, num_experts, block_m, device)
    max_padded, num_blocks = blocks.sorted_slot_ids.numel(), blocks.block_expert_ids.numel()
    block_bins = triton.next_power_of_2(num_experts + 1)
    num_chunks = triton.cdiv(num_slots, chunk)
    counts = torch.empty(num_chunks, block_bins, dtype=torch.int32, device=device)
    starts = torch.empty(block_bins, dtype=torch.int32, device=device)
    rows, block_nb = max(1, 4096 // block_bins), max(1, 8192 // block_bins)
    # Loop trip counts are compile-time constants (Triton 3.6's interpreter takes no loop bound from
    # an argument), rounded up to powers of two so that batch sizes share a few compiled variants;
    # the extra steps are masked off.
    steps = {"FILL_STEPS": triton.next_power_of_2(triton.cdiv(triton.cdiv(max_padded, num_chunks), chunk)),
             "CHUNK_TILES": triton.next_power_of_2(triton.cdiv(num_chunks, rows)),
             "BLOCK_TILES": triton.next_power_of_2(triton.cdiv(num_blocks, block_nb))}
    warps = 4 if chunk <= 1024 else 8
    _chunk_count_kernel[(num_chunks,)](flat, counts, blocks.sorted_slot_ids, num_slots, num_experts, max_padded,
                                       CHUNK=chunk, BLOCK_BINS=block_bins, FILL_STEPS=steps["FILL_STEPS"],
                                       num_warps=warps)
    _chunk_offsets_kernel[(1,)](counts, starts, blocks.block_expert_ids, blocks.num_padded, num_chunks, num_experts,
                                num_blocks, BLOCK_M=block_m, BLOCK_BINS=block_bins, ROWS=rows, BLOCK_NB=block_nb,
                                CHUNK_TILES=steps["CHUNK_TILES"], BLOCK_TILES=steps["BLOCK_TILES"], num_warps=8)
    _chunk_scatter_kernel[(num_chunks,)](flat, counts, starts, blocks.sorted_slot_ids, num_slots, num_experts,
                                         CHUNK=chunk, BLOCK_BINS=block_bins, num_warps=warps)
    return blocks
