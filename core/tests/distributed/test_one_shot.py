"""The one-shot all-reduce kernel (engine.distributed.one_shot) in one process, its peers faked.

The peers' buffers and flags are ordinary tensors of this process, so the kernel's pointer
tables address them like a peer's mapped memory; each peer's part of a call is written into the
half of its buffer that call uses, and its signal is set before the launch (a real peer's would
arrive while the kernel waits). Runs under the Triton interpreter on a machine without a GPU
(the workspace conftest sets it) and on the GPU where there is one. The two-GPU test against
NCCL is ``test_one_shot_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from engine.distributed.one_shot import BLOCK, one_shot_all_reduce_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class FakeGroup:
    """``world`` ranks' buffers (two halves of ``half`` elements) and flags, seen from ``rank``."""

    def __init__(self, world: int, rank: int, half: int, dtype: torch.dtype) -> None:
        self.world, self.rank, self.half, self.dtype = world, rank, half, dtype
        self.programs = -(-half // BLOCK)
        self.bufs = [torch.zeros(2 * half, dtype=dtype, device=DEVICE) for _ in range(world)]
        self.flags = [torch.zeros(self.programs * world, dtype=torch.int64, device=DEVICE) for _ in range(world)]
        self.counts = torch.zeros(self.programs, dtype=torch.int64, device=DEVICE)
        self.buf_ptrs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64, device=DEVICE)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64, device=DEVICE)

    def call(self, x: torch.Tensor, peers: dict[int, torch.Tensor], call: int) -> None:
        """Stages the peers' parts of call number ``call`` (1, 2, ...) and runs this rank's kernel."""
        part = (call % 2) * self.half
        for r, t in peers.items():
            self.bufs[r][part:part + t.numel()] = t
            self.flags[self.rank].view(self.programs, self.world)[:, r] = call
        n = x.numel()
        one_shot_all_reduce_kernel[(-(-n // BLOCK),)](x, n, self.buf_ptrs, self.flag_ptrs, self.counts, self.rank,
                                                       self.half, WORLD=self.world, BLOCK=BLOCK)


@pytest.mark.parametrize("world, rank", [(2, 0), (2, 1), (4, 2)])
def test_sums_every_rank_in_rank_order(world: int, rank: int) -> None:
    g = FakeGroup(world, rank, half=4 * BLOCK, dtype=torch.float32)
    gen = torch.Generator(device=DEVICE).manual_seed(world * 10 + rank)
    n = 2 * BLOCK + 100  # two whole programs and a partial one
    for call in (1, 2, 3):
        parts = [torch.randn(n, device=DEVICE, generator=gen) for _ in range(world)]
        want = parts[0].clone()
        for p in parts[1:]:
            want += p  # float32, rank order: what the kernel adds
        x = parts[rank].clone()
        g.call(x, {r: parts[r] for r in range(world) if r != rank}, call)
        assert torch.equal(x, want), f"call {call}"
        # Its own part went to this call's half of its buffer, for the peers to read.
        part = (call % 2) * g.half
        assert torch.equal(g.bufs[rank][part:part + n], parts[rank])
        # It told every peer, in the peer's flag slot [program][rank], for the 3 programs it ran.
        for r in range(world):
            if r != rank:
                slots = g.flags[r].view(g.programs, world)[:, rank]
                assert slots[:3].tolist() == [call] * 3 and slots[3:].tolist() == [0] * (g.programs - 3)
        assert g.counts.tolist() == [call] * 3 + [0] * (g.programs - 3)


def test_halves_alternate() -> None:
    """Call 2 reads the peers' even half, not what call 1 left in the odd one."""
    g = FakeGroup(2, 0, half=BLOCK, dtype=torch.float32)
    peer1 = torch.full((BLOCK,), 5.0, device=DEVICE)
    x = torch.ones(BLOCK, device=DEVICE)
    g.call(x, {1: peer1}, 1)
    assert torch.equal(x, torch.full_like(x, 6.0))
    assert torch.equal(g.bufs[1][BLOCK:], peer1)  # call 1 used the odd half
    peer2 = torch.full((BLOCK,), 7.0, device=DEVICE)
    x = torch.ones(BLOCK, device=DEVICE)
    g.call(x, {1: peer2}, 2)
    assert torch.equal(x, torch.full_like(x, 8.0))
    assert torch.equal(g.bufs[1][BLOCK:], peer1)  # untouched by call 2


def test_bf16_sums_in_float32() -> None:
    """256 + 1 + 1 in bf16 step by step stays 256 (each + 1 is a tie, rounded to even); summed in
    float32 and rounded once it is 258, which bf16 holds exactly."""
    g = FakeGroup(4, 3, half=BLOCK, dtype=torch.bfloat16)
    peers = {r: torch.full((BLOCK,), v, dtype=torch.bfloat16, device=DEVICE) for r, v in ((0, 256.0), (1, 1.0), (2, 1.0))}
    x = torch.zeros(BLOCK, dtype=torch.bfloat16, device=DEVICE)
    g.call(x, peers, 1)
    assert x.float().unique().tolist() == [258.0]
