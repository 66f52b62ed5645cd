"""Times the Triton skinny GEMM (the cuda platform's ``linear`` layer kernel) against ``F.linear``
(cuBLAS) at decode shapes, on the current GPU.

Run from the repository root on a GPU machine:

    PYTHONPATH=core/src:plugins/platform-cuda/src python3 plugins/platform-cuda/benchmarks/bench_gemv.py \\
        [--rows 1 2 4 8] [--shapes 5120x2048 ...] [--dtype bf16] [--sweep] [--result-file F.jsonl]

For each row count M and weight shape (N, K) it builds one CUDA graph of ``--calls`` calls (20 by
default) of each implementation and times replays with CUDA events: the median replay time over
the calls is the time of one call without launch overhead, as when serving under CUDA graphs.
The calls cycle through copies of the weight that together exceed ``--cold-mb`` (256 MB, five
times an H100's 50 MB L2), so W comes from HBM as in a real decode step; for a small weight (the
router, 0.5 MB) the graph holds as many calls as copies, so it has more than ``--calls`` calls.
Effective bandwidth is (W + x + y [+ bias]) bytes over the time, beside the device-to-device copy
bandwidth measured at start (bytes read + written over time).

Each line also gives the kernel's launch shape (``choose_config``) and its agreement with
F.linear (max abs difference, relative L2 error against a float64 reference for both).
``--sweep`` also times alternatives around the chosen shape (block sizes, split-K, stages, warps,
the other kind) and names the fastest, to tune ``GemvRule``; the summary adds the per-step total of
the Qwen3-30B-A3B decode GEMMs (48 x (qkv + o + router) + LM head) at each M.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.nn.functional as F
from engine_platform_cuda.gemv import GemvConfig, choose_config, skinny_linear

from engine.bench.results import append_rows

#: (N, K): Qwen3-30B-A3B qkv, o, router, LM head; Llama-3-8B qkv, o, gate_up, down, LM head.
SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (6144, 4096), (4096, 4096),
          (28672, 4096), (4096, 14336), (128256, 4096)]
#: Qwen3-30B-A3B: per layer qkv, o, router (48 layers), then the LM head once per step.
QWEN_LAYER = [(5120, 2048), (2048, 4096), (128, 2048)]
QWEN_HEAD = (151936, 2048)
QWEN_LAYERS = 48
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def copy_bandwidth_tbs(reps: int = 20) -> float:
    """Device-to-device copy of 1 GiB: bytes read plus written over the median time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_ms(lambda: dst.copy_(src), reps) * 1e-3) / 1e12


def time_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median over ``reps`` of ``fn`` timed with CUDA events (after two warm-up runs)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_us(calls: list[Callable[[], Any]], reps: int) -> float:
    """Microseconds per call when ``calls`` run back to back inside one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile (Triton) and pick algorithms (cuBLAS) outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = time_ms(graph.replay, reps)
    del graph
    return ms * 1e3 / len(calls)


def rel_l2(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()


def sweep_configs(chosen: GemvConfig, m: int) -> list[GemvConfig]:
    """Alternatives one step from ``chosen``, plus the other kind's usual shapes."""
    c = chosen
    alts: list[GemvConfig] = [
        replace(c, block_n=c.block_n * 2), replace(c, block_k=c.block_k * 2),
        replace(c, split_k=c.split_k * 2), replace(c, split_k=max(1, c.split_k // 2)),
        replace(c, num_warps=8 if c.num_warps == 4 else 4),
    ]
    if c.block_n > (16 if c.kind == "dot" else 1):
        alts.append(replace(c, block_n=c.block_n // 2))
    if c.block_k > 32:
        alts.append(replace(c, block_k=c.block_k // 2))
    if c.kind == "fma":
        alts += [replace(c, num_stages=3),
                 GemvConfig("dot", 16, 128, num_stages=4), GemvConfig("dot", 64, 128, num_stages=4)]
    else:
        alts += [replace(c, num_stages=3), replace(c, num_stages=5)]
        if m <= 8:
            alts += [GemvConfig("fma", 4, 256), GemvConfig("fma", 2, 512)]
    seen, out = {c}, []
    for alt in alts:
        if alt not in seen:
            seen.add(alt)
            out.append(alt)
    return out


def bench_shape(m: int, n: int, k: int, dtype: torch.dtype, args: argparse.Namespace,
                copy_tbs: float) -> list[dict[str, Any]]:
    esize = torch.empty((), dtype=dtype).element_size()
    w_bytes = n * k * esize
    copies = max(1, -(-(args.cold_mb << 20) // w_bytes))
    calls = max(args.calls, copies)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype) for _ in range(copies)]
    bias = None
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    io_bytes = w_bytes + (m * k + m * n) * esize

    def calls_of(fn: Callable[[torch.Tensor], Any]) -> list[Callable[[], Any]]:
        return [(lambda w=weights[i % copies]: fn(w)) for i in range(calls)]

    chosen = choose_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count, esize)
    torch_us = graph_us(calls_of(lambda w: F.linear(x, w, bias)), args.reps)
    triton_us = graph_us(calls_of(lambda w: skinny_linear(x, w, bias)), args.reps)
    exact = F.linear(x.double(), weights[0].double())
    ref = F.linear(x, weights[0])
    got = skinny_linear(x, weights[0])
    base = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""), "m": m, "n": n, "k": k,
        "weight_mb": round(w_bytes / 2**20, 2), "copies": copies, "calls": calls,
        "copy_tbs": round(copy_tbs, 3),
    }
    line = dict(base, kind="compare", config=asdict(chosen),
                torch_us=round(torch_us, 2), triton_us=round(triton_us, 2),
                torch_tbs=round(io_bytes / (torch_us * 1e-6) / 1e12, 3),
                triton_tbs=round(io_bytes / (triton_us * 1e-6) / 1e12, 3),
                speedup=round(torch_us / triton_us, 3),
                max_abs_diff=(got.float() - ref.float()).abs().max().item(),
                rel_l2_triton=rel_l2(got, exact), rel_l2_torch=rel_l2(ref, exact))
    cfg = chosen
    print(f"M={m} {n:>6}x{k:<5} {line['weight_mb']:8.2f} MB | F.linear {torch_us:8.2f} us "
          f"{line['torch_tbs']:5.2f} TB/s | triton {triton_us:8.2f} us {line['triton_tbs']:5.2f} TB/s | "
          f"x{line['speedup']:.2f} | {cfg.kind} n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} "
          f"w{cfg.num_warps} st{cfg.num_stages} | diff {line['max_abs_diff']:.2e}", flush=True)
    lines = [line]
    if args.sweep:
        best = (triton_us, chosen)
        for alt in sweep_configs(chosen, m):
            try:
                us = graph_us(calls_of(lambda w, alt=alt: skinny_linear(x, w, bias, config=alt)), args.reps)
            except Exception as exc:  # an alternative that does not compile or fit is reported, not fatal
                print(f"    {alt}: failed: {str(exc).splitlines()[0][:160]}", flush=True)
                continue
            lines.append(dict(base, kind="sweep", config=asdict(alt), triton_us=round(us, 2),
                              triton_tbs=round(io_bytes / (us * 1e-6) / 1e12, 3)))
            print(f"    {alt.kind} n{alt.block_n} k{alt.block_k} s{alt.split_k} w{alt.num_warps} "
                  f"st{alt.num_stages}: {us:8.2f} us", flush=True)
            best = min(best, (us, alt), key=lambda b: b[0])
        lines.append(dict(base, kind="sweep_best", config=asdict(best[1]), triton_us=round(best[0], 2),
                          chosen_us=round(triton_us, 2)))
        print(f"    best: {best[1]} {best[0]:.2f} us (chosen {triton_us:.2f} us)", flush=True)
    weights.clear()
    torch.cuda.empty_cache()
    return lines


def qwen_step_summary(lines: list[dict[str, Any]]) -> list[str]:
    """Per-step time of the Qwen3-30B-A3B decode GEMMs at each M where every shape was timed."""
    out = []
    for m in sorted({ln["m"] for ln in lines}):
        got = {(ln["n"], ln["k"]): ln for ln in lines if ln["m"] == m and ln["kind"] == "compare"}
        if not all(s in got for s in QWEN_LAYER + [QWEN_HEAD]):
            continue
        for impl in ("torch", "triton"):
            us = QWEN_LAYERS * sum(got[s][f"{impl}_us"] for s in QWEN_LAYER) + got[QWEN_HEAD][f"{impl}_us"]
            out.append(f"Qwen3-30B-A3B step GEMMs (48 x qkv+o+router + LM head), M={m}, {impl}: {us / 1e3:.3f} ms")
    return out


def parse_shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: invalid value {text!r}; expected NxK, e.g. 5120x2048") from None
    return n, k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="row counts M (1..16)")
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=SHAPES, help="weights NxK")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph (at least)")
    ap.add_argument("--cold-mb", type=int, default=256, help="weight copies cycled per graph, in MB at least")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed (median)")
    ap.add_argument("--sweep", action="store_true", help="also time alternatives to the chosen launch shape")
    ap.add_argument("--result-file", default=None, help="append one JSON line per measurement")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv.py needs a CUDA GPU")
    bad = [m for m in args.rows if not 1 <= m <= 16]
    if bad:
        raise SystemExit(f"--rows: invalid value {bad[0]}; accepted: 1..16")
    dtype = DTYPES[args.dtype]
    copy_tbs = copy_bandwidth_tbs()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.dtype}; "
          f"device-to-device copy {copy_tbs:.2f} TB/s (read + write)", flush=True)
    lines: list[dict[str, Any]] = []
    for m in args.rows:
        for n, k in args.shapes:
            lines += bench_shape(m, n, k, dtype, args, copy_tbs)
    for text in qwen_step_summary(lines):
        print(text)
    append_rows(args.result_file, *lines)


if __name__ == "__main__":
    main()
