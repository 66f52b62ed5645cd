"""Whether weights staged in L2 survive the bytes a decode layer streams after them (GPU only).

The question behind it: a batch-1 MoE decode layer leaves the memory system idle while its
attention runs, and the next weights whose addresses are known then are the next layer's qkv
projection. Staging them in L2 helps only if they are still there after the output projection
and the experts (about 92 MB at the Qwen3-30B-A3B shape) have streamed through the 50 MB L2.

Each scenario is a sequence ``stage A; stream B; read A`` over ``--buffers`` pairs of buffers
(cycled, so a replay never starts with its own A hot), timed in one CUDA graph, minus the same
sequence without the last read. So each row is the time of reading A (``--a-mb``) after B
(``--b-mb``), for the way A was staged and the L2 eviction hint B was streamed with:

- ``cold``: nothing staged, B streamed with no hint;
- ``load_last``: A read once with ``evict_last`` loads; ``prefetch_last``: A staged with
  ``cp.async.bulk.prefetch.L2`` and an ``evict_last`` cache policy (the cuda plugin's
  ``l2_prefetch.prefetch_to_l2``, as ``cuda.l2_prefetch_mb`` stages weights);
- ``B first``: B's loads carry ``evict_first``.

``stage_in_l2`` is the staging as ``scripts/bench_decode_floor.py``'s ``stage_*`` variants use it
inside a decode step.

usage: python scripts/bench_l2_retention.py [--a-mb 21] [--b-mb 17 92] [--buffers 4]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
from engine_platform_cuda.graph_timing import graph_median_us
from engine_platform_cuda.l2_prefetch import CHUNK_BYTES, PER_PROGRAM, prefetch_to_l2

CHUNK, BLOCK, WARPS = 8192, 2048, 8
#: What ``stage_in_l2("pfN")`` stages a program: N of them, 2 MiB each.
PROGRAM_BYTES = CHUNK_BYTES * PER_PROGRAM


@triton.jit
def _read_kernel(x_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, POLICY: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(0, CHUNK, BLOCK):
        if POLICY == 1:
            v = tl.load(x_ptr + pid * CHUNK + s + offs, eviction_policy="evict_first")
        elif POLICY == 2:
            v = tl.load(x_ptr + pid * CHUNK + s + offs, eviction_policy="evict_last")
        else:
            v = tl.load(x_ptr + pid * CHUNK + s + offs)
        acc += v.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _stage_load_kernel(x_ptr, out_ptr, n_steps, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                       PROGRAMS: tl.constexpr):
    # PROGRAMS persistent programs read x with evict_last loads (a few SMs, leaving the rest to the
    # kernels running beside them); the sums are stored so the loads stay.
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(pid, n_steps, PROGRAMS):
        base = x_ptr + i.to(tl.int64) * (BLOCK * UNROLL)
        for u in tl.static_range(UNROLL):
            acc += tl.load(base + u * BLOCK + offs, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def stage_in_l2(w: torch.Tensor, how: str, sink: torch.Tensor) -> None:
    """Requests ``w``'s bytes into L2 with an ``evict_last`` policy. ``how``: ``pf[N]``, bulk
    prefetches (``N`` programs of 2 MB each; all of ``w`` without ``N``); ``ld[N]``, ``evict_last``
    loads from ``N`` persistent programs (64 without ``N``). ``sink``: float32, at least 64K values."""
    if how[:2] not in ("pf", "ld") or not (how[2:] == "" or how[2:].isdigit()):
        raise ValueError(f"stage_in_l2: how={how!r}; accepted: pf, pfN, ld, ldN")
    count = int(how[2:]) if how[2:] else None
    if how.startswith("ld"):
        block, unroll, programs = 2048, 8, count or 64
        _stage_load_kernel[(programs,)](w, sink, w.numel() // (block * unroll), BLOCK=block, UNROLL=unroll,
                                        PROGRAMS=programs, num_warps=8)
    else:
        nbytes = count * PROGRAM_BYTES if count else w.numel() * w.element_size()
        prefetch_to_l2(w, nbytes, sink.view(torch.int32))


def _read(x: torch.Tensor, out: torch.Tensor, policy: int) -> None:
    _read_kernel[(x.numel() // CHUNK,)](x, out, CHUNK=CHUNK, BLOCK=BLOCK, POLICY=policy, num_warps=WARPS)


def _prefetch(x: torch.Tensor, out: torch.Tensor) -> None:
    prefetch_to_l2(x, x.numel() * x.element_size(), out.view(torch.int32))


def _buffer(megabytes: float) -> torch.Tensor:
    quantum = PROGRAM_BYTES  # whole 2 MiB prefetch programs (and read programs: 16 KiB each)
    nbytes = max(int(megabytes * 1e6) // quantum, 1) * quantum
    return torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a-mb", type=float, default=21.0)
    parser.add_argument("--b-mb", type=float, nargs="+", default=[17.0, 92.0])
    parser.add_argument("--buffers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    a_bufs = [_buffer(args.a_mb) for _ in range(args.buffers)]
    out = torch.empty(1 << 20, device="cuda")
    stage = {
        "cold": lambda a: None,
        "load_last": lambda a: _read(a, out, 2),
        "prefetch_last": lambda a: _prefetch(a, out),
    }

    def timed(calls) -> float:
        return graph_median_us([lambda: [c() for c in calls]], reps=args.reps) / args.buffers

    print(f"{torch.cuda.get_device_name()}  {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}  "
          f"A {a_bufs[0].numel() * 2 / 1e6:.1f} MB")
    seq = [lambda a=a: _read(a, out, 0) for a in a_bufs]
    print(f"A read cold, alone: {timed(seq):.2f} us")
    hot = timed([c for a in a_bufs for c in (lambda a=a: _read(a, out, 0),) * 2])
    print(f"A read twice in a row, per pair: {hot:.2f} us")
    for name in ("prefetch_last",):
        print(f"{name} kernel alone: {timed([lambda a=a, s=stage[name]: s(a) for a in a_bufs]):.2f} us")
    for b_mb in args.b_mb:
        b_bufs = [_buffer(b_mb) for _ in range(args.buffers)]
        for b_policy, b_name in ((0, "B normal"), (1, "B first")):
            for name, fn in stage.items():
                pairs = list(zip(a_bufs, b_bufs, strict=True))
                head = [c for a, b in pairs
                        for c in (lambda a=a, f=fn: f(a), lambda b=b, p=b_policy: _read(b, out, p))]
                full = [c for a, b in pairs
                        for c in (lambda a=a, f=fn: f(a), lambda b=b, p=b_policy: _read(b, out, p),
                                  lambda a=a: _read(a, out, 0))]
                t_head, t_full = timed(head), timed(full)
                print(f"B {b_bufs[0].numel() * 2 / 1e6:6.1f} MB {b_name:8s} stage {name:13s}: "
                      f"read A {t_full - t_head:7.2f} us  (whole sequence {t_full:7.2f} us)")
        del b_bufs


if __name__ == "__main__":
    main()
