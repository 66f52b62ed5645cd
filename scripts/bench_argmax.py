"""Times the sampler's greedy argmax: ``torch.argmax(logits, dim=-1)`` (a memset and a reduce
kernel) against the cuda platform's one-launch kernel ``argmax.argmax_rows``, on the current GPU.

Run from the repository root on a GPU machine:

    PYTHONPATH=core/src:plugins/platform-cuda/src python3 scripts/bench_argmax.py \\
        [--rows 1 8 64] [--vocab 151936 128256] [--dtype fp32] [--calls 20] [--reps 50]

For each row count and vocabulary size, float32 logits (as the LM head hands the sampler) are
argmaxed ``--calls`` times in one CUDA graph (``graph_timing.graph_median_us``): the median replay
time over the calls is the device time of one call, launch gaps included. The logits stay in L2
between calls, as they are when the sampler reads what the LM head just wrote. ``host us`` is the
CPU time of one eager call (the sampler runs outside graphs), launches queued without a sync.
Each line also says whether the two agree (the kernel must equal ``torch.argmax`` exactly).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from engine_platform_cuda.argmax import argmax_rows

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Timer = Callable[[Sequence[Callable[[], Any]]], float]


def host_us(fn: Callable[[], Any], calls: int) -> float:
    """CPU microseconds per eager call of ``fn`` (after a warm-up call), without waiting for the device."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1e6 / calls


def measure(rows: int, vocab: int, dtype: torch.dtype, device: str, calls: int, timer: Timer) -> dict[str, Any]:
    """One table row: device and host microseconds per call of each, and whether they agree."""
    gen = torch.Generator(device=device).manual_seed(rows * 7 + vocab)
    x = torch.randn(rows, vocab, generator=gen, device=device).to(dtype)
    torch_fn = lambda: torch.argmax(x, dim=-1)  # noqa: E731
    kernel_fn = lambda: argmax_rows(x)  # noqa: E731
    return {"rows": rows, "vocab": vocab, "same": bool(torch.equal(kernel_fn(), torch_fn())),
            "torch_us": timer([torch_fn] * calls), "kernel_us": timer([kernel_fn] * calls),
            "torch_host_us": host_us(torch_fn, calls), "kernel_host_us": host_us(kernel_fn, calls)}


def format_table(results: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'rows':>5} {'vocab':>7} {'torch us':>9} {'kernel us':>10} {'speed-up':>9} "
             f"{'host us (torch / kernel)':>25}  same"]
    for r in results:
        lines.append(f"{r['rows']:>5} {r['vocab']:>7} {r['torch_us']:>9.2f} {r['kernel_us']:>10.2f} "
                     f"{r['torch_us'] / r['kernel_us']:>8.2f}x {r['torch_host_us']:>12.1f} / "
                     f"{r['kernel_host_us']:<10.1f}  {'yes' if r['same'] else 'NO'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--vocab", type=int, nargs="+", default=[151936, 128256])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--calls", type=int, default=20, help="calls in one graph (default 20)")
    ap.add_argument("--reps", type=int, default=50, help="graph replays, the median taken (default 50)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_argmax: needs a CUDA GPU (torch.cuda.is_available() is False)")
    from engine_platform_cuda.graph_timing import graph_median_us

    print(torch.cuda.get_device_name(), f"{DTYPES[args.dtype]}, {args.calls} calls a graph, median of {args.reps}")
    timer: Timer = lambda calls: graph_median_us(calls, reps=args.reps)  # noqa: E731
    results = [measure(rows, vocab, DTYPES[args.dtype], "cuda", args.calls, timer)
               for vocab in args.vocab for rows in args.rows]
    print(format_table(results))


if __name__ == "__main__":
    main()
