"""Tensor-parallel all-reduce latency on the GPUs of one host: NCCL, torch's symmetric-memory
one-shot op (with the copy into its buffer), and this project's one-shot kernel
(engine.distributed.one_shot), eager and inside a CUDA graph, by message size.

    NCCL_NVLS_ENABLE=0 python3 benchmarks/bench_all_reduce.py [--world 2] [--sizes-kb 8 64 512 2048]

Each variant's result is first checked against NCCL's (bf16, random inputs). Prints one JSON
line per (variant, size, mode) with the microseconds a call (``_time``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_platform_cuda.graph_timing import graph_median_us

from engine.distributed.ranks import free_port


def _time(fn, graph: bool, reps: int) -> float:
    """Microseconds a call: in a graph, the median of 5 replays of ``reps`` calls captured in one
    graph; eager, the mean of ``reps`` calls in a row after 20 untimed ones."""
    if graph:
        return graph_median_us([fn] * reps, reps=5)
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def _worker(rank: int, world: int, port: int, sizes_kb: list[int], reps: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    import torch.distributed._symmetric_memory as symm_mem

    from engine.distributed.one_shot import PeerBuffers

    group = dist.group.WORLD.group_name
    dev = torch.device("cuda", rank)
    max_bytes = max(sizes_kb) << 10
    ours = PeerBuffers(group, dev, torch.bfloat16, max_bytes)
    tbuf = symm_mem.empty(max_bytes // 2, dtype=torch.bfloat16, device=dev)
    symm_mem.rendezvous(tbuf, group)
    for kb in sizes_kb:
        n = (kb << 10) // 2
        gen = torch.Generator(device=dev).manual_seed(1234 + rank)
        src = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=gen)
        ref = src.clone()
        dist.all_reduce(ref)
        x = src.clone()
        ours.all_reduce_(x)
        torch.cuda.synchronize()
        ok = torch.equal(x, ref)
        # Many calls in a row (both halves, counts advancing), then the check again.
        for _ in range(7):
            x.copy_(src)
            ours.all_reduce_(x)
        torch.cuda.synchronize()
        ok = ok and torch.equal(x, ref)
        y = src.clone()
        torch.ops.symm_mem.one_shot_all_reduce_out(tbuf[:n].copy_(src), "sum", group, y)
        tok = torch.equal(y, ref)
        work = src.clone()

        def nccl() -> None:
            dist.all_reduce(work)

        def torch_one_shot() -> None:
            slot = tbuf[:n]
            slot.copy_(work)
            torch.ops.symm_mem.one_shot_all_reduce_out(slot, "sum", group, work)

        def one_shot() -> None:
            ours.all_reduce_(work)

        for name, fn, correct in (("nccl", nccl, True), ("torch_symm_one_shot", torch_one_shot, tok),
                                  ("engine_one_shot", one_shot, ok)):
            for graph in (False, True):
                us = _time(fn, graph, reps)
                if rank == 0:
                    print(json.dumps({"variant": name, "kb": kb, "graph": graph, "us": round(us, 2),
                                      "equal_to_nccl": bool(correct), "world": world}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes-kb", type=int, nargs="+", default=[8, 64, 512, 2048])
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(_worker, args=(args.world, free_port(), args.sizes_kb, args.reps), nprocs=args.world)


if __name__ == "__main__":
    main()
