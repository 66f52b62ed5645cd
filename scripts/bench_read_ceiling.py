"""How fast one kernel can read a cold buffer of a given size on this GPU: the ceiling a
weight-streaming decode kernel of that many bytes is compared with (GPU only).

For each size, a Triton kernel whose programs each read ``chunk`` contiguous bf16 values (in
``block`` vectors) and store their float32 sum, in each of a few tilings, is timed inside a CUDA
graph (``graph_median_us``) that cycles through six buffers of that size, so no call finds its
bytes in L2. It prints the best tiling's time and rate, and ``torch.sum``'s time on the same buffers.
A launch's fixed cost (the ramp until the first bytes arrive, and the tail) shows as the intercept
of time against size.

usage: python scripts/bench_read_ceiling.py [--mb 21 25.2 50.3 75.5] [--result-file out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl
from engine_platform_cuda.graph_timing import graph_median_us

from engine.bench.results import append_rows

#: (chunk, block, num_warps) tilings tried at each size.
TILINGS = [(1024, 1024, 4), (2048, 1024, 4), (4096, 1024, 4), (4096, 2048, 8), (8192, 2048, 8),
           (16384, 4096, 8), (8192, 1024, 4), (2048, 2048, 8)]
BUFFERS = 6


@triton.jit
def _read_kernel(x_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(0, CHUNK, BLOCK):
        acc += tl.load(x_ptr + pid * CHUNK + s + offs).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def measure(megabytes: float) -> dict[str, object]:
    # A whole number of the largest chunk (16384 values, 32 KiB), so every tiling covers it exactly.
    nbytes = int(megabytes * 1e6) // 65536 * 65536
    bufs = [torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(BUFFERS)]
    results = []
    for chunk, block, warps in TILINGS:
        programs = nbytes // 2 // chunk
        out = torch.empty(programs, device="cuda")
        calls = [lambda b=b, c=chunk, k=block, w=warps, p=programs: _read_kernel[(p,)](b, out, CHUNK=c, BLOCK=k,
                                                                                      num_warps=w)
                 for b in bufs]
        results.append((graph_median_us(calls), chunk, block, warps))
    results.sort()
    us, chunk, block, warps = results[0]
    row = {"bench": "read_ceiling", "megabytes": round(nbytes / 1e6, 2), "best_us": round(us, 2),
           "tb_per_s": round(nbytes / us / 1e6, 3), "chunk": chunk, "block": block, "warps": warps,
           "torch_sum_us": round(graph_median_us([lambda b=b: b.sum() for b in bufs]), 2),
           "gpu": torch.cuda.get_device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    del bufs
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", nargs="+", type=float, default=[21.0, 25.2, 50.3, 75.5],
                    help="buffer sizes in MB (defaults: Qwen3-30B-A3B's qkv, down, gate/up and all 8 experts)")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_read_ceiling: needs a CUDA GPU")
    for mb in a.mb:
        row = measure(mb)
        print(json.dumps(row), flush=True)
        append_rows(a.result_file, row)


if __name__ == "__main__":
    main()
