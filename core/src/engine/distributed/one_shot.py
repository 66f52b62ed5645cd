"""One-shot all-reduce over peer memory: one Triton kernel, no NCCL.

Every rank holds a symmetric buffer (torch symmetric memory: the same allocation mapped into
every rank of the group, reachable over NVLink) and a symmetric array of int64 flags. A call
runs ``cdiv(n, BLOCK)`` programs on each rank; program ``p``

1. copies its chunk of ``x`` into its own buffer (this call's half of it),
2. tells every peer's program ``p`` so: a release store (system scope) of its call count into
   the peer's flag slot ``[p][rank]``,
3. waits, with acquire loads, until every peer's flag slot ``[p][peer]`` has reached the count,
4. sums the chunk of every rank's buffer in rank order (float32; the same order on every rank,
   so every rank ends with the same bits) and writes the sum over ``x``.

Programs synchronise only with their namesakes on the other ranks: there is no grid-wide
barrier, so any grid size works. Two halves of the buffer alternate by call count: a rank can
start call ``c + 1`` (writing the other half) while a peer still reads call ``c``'s half, and it
cannot reach call ``c + 2`` (writing that half again) before the peer has signalled ``c + 1``,
which the peer does only after finishing call ``c``. The counts live on the device (one per
program), so the kernel can be captured in a CUDA graph and replayed. Flags only grow (int64),
and a waiter checks ``flag >= count``, so a peer that already moved on to the next call cannot
make it miss the current one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements a program; 16-byte vectors per thread at 4 warps in bf16
NUM_WARPS = 4


@triton.jit
def one_shot_all_reduce_kernel(x_ptr, n, buf_ptrs, flag_ptrs, counts_ptr, rank, half_elems,
                               WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    count = tl.load(counts_ptr + pid) + 1
    tl.store(counts_ptr + pid, count)
    half = (count % 2) * half_elems
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=mask)
    # Symmetric buffers are 16-byte aligned (the hint lets the copies use 16-byte vectors).
    own = tl.multiple_of(tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype)), 16)
    tl.store(own + half + offs, x, mask=mask)
    # Every thread's store is done before the signal (the signal's release covers them).
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != rank:
            peer_flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_flags + pid * WORLD + rank, count, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int64))
    for r in tl.static_range(WORLD):
        if r != rank:
            seen = tl.atomic_add(own_flags + pid * WORLD + r, 0, sem="acquire", scope="sys")
            while seen < count:
                seen = tl.atomic_add(own_flags + pid * WORLD + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        src = tl.multiple_of(tl.load(buf_ptrs + r).to(tl.pointer_type(dtype)), 16)
        acc += tl.load(src + half + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
    tl.store(x_ptr + offs, acc.to(dtype), mask=mask)


class PeerBuffers:
    """One dtype's symmetric buffer (two halves of ``max_bytes``), the group's flags and this
    rank's call counts. Made collectively: every rank of the group must construct it together."""

    def __init__(self, group_name: str, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from engine.platforms import synchronize_device

        self.half_elems = max_bytes // dtype.itemsize
        max_programs = -(-self.half_elems // BLOCK)
        self.buffer = symm_mem.empty(2 * self.half_elems, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.buffer, group_name)
        self.rank, self.world = handle.rank, handle.world_size
        self.flags = symm_mem.empty(max_programs * self.world, dtype=torch.int64, device=device)
        self.flags.zero_()
        flag_handle = symm_mem.rendezvous(self.flags, group_name)
        self.counts = torch.zeros(max_programs, dtype=torch.int64, device=device)
        self.buf_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(flag_handle.buffer_ptrs, dtype=torch.int64, device=device)
        # No rank may signal into a peer's flags before that peer has zeroed them.
        synchronize_device(device)
        handle.barrier()

    def all_reduce_(self, x: torch.Tensor) -> None:
        """Sums contiguous ``x`` (at most ``half_elems`` elements) over the group, in place."""
        n = x.numel()
        one_shot_all_reduce_kernel[(-(-n // BLOCK),)](
            x, n, self.buf_ptrs, self.flag_ptrs, self.counts, self.rank, self.half_elems,
            WORLD=self.world, BLOCK=BLOCK, num_warps=NUM_WARPS)
