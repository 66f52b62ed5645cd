"""The one-shot all-reduce kernel (engine.distributed.one_shot) on two GPUs against NCCL.

Skipped unless two CUDA GPUs are visible. Run with NCCL_NVLS_ENABLE=0 (no NVLink multicast).
Every size, dtype and repetition must equal NCCL's sum bit for bit (two ranks: one rounding of
an exact float32 sum either way), on every rank, eagerly and replayed from a CUDA graph.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _worker(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from engine.distributed.one_shot import BLOCK, PeerBuffers

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev)
    group = dist.group.WORLD.group_name
    for dtype in (torch.bfloat16, torch.float32):
        peers = PeerBuffers(group, dev, dtype, 1 << 20)
        # Sizes: one partial program, several, a whole number of programs, the buffer's half.
        for n in (8, 4096, 3 * BLOCK + 40, 16 * BLOCK, peers.half_elems):
            gen = torch.Generator(device=dev).manual_seed(n * 7 + rank)
            for rep in range(5):  # both halves of the buffer, counts advancing
                src = torch.randn(n, device=dev, dtype=dtype, generator=gen)
                ref = src.clone()
                dist.all_reduce(ref)
                x = src.clone()
                peers.all_reduce_(x)
                torch.cuda.synchronize()
                assert torch.equal(x, ref), f"rank {rank} {dtype} n={n} rep={rep}: differs from NCCL"
        # Replayed from a graph: three all-reduces of different sizes, new inputs every replay.
        xs = [torch.empty(n, device=dev, dtype=dtype) for n in (4096, 8, 5 * BLOCK)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for x in xs:
                peers.all_reduce_(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x in xs:
                peers.all_reduce_(x)
        for rep in range(4):
            srcs = [torch.randn(x.numel(), device=dev, dtype=dtype) * (rank + 1) for x in xs]
            refs = [s.clone() for s in srcs]
            for r in refs:
                dist.all_reduce(r)
            for x, s in zip(xs, srcs):
                x.copy_(s)
            graph.replay()
            torch.cuda.synchronize()
            for x, r in zip(xs, refs):
                assert torch.equal(x, r), f"rank {rank} {dtype} graph replay {rep}: differs from NCCL"
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")
def test_one_shot_equals_nccl_on_two_gpus() -> None:
    import torch.multiprocessing as mp

    from engine.ports import free_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(_worker, args=(2, free_port()), nprocs=2)
