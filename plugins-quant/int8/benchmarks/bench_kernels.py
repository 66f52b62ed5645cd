"""Micro-benchmark of the w8a8_int8 kernels at the Llama-3-8B linear shapes (needs a CUDA GPU).

    python plugins-quant/int8/benchmarks/bench_kernels.py [--m 1,2,4,8,16,32,64,128,256] [--shapes qkv,o,gate_up,down]
    python plugins-quant/int8/benchmarks/bench_kernels.py --sweep [--m 1,4,16,64,256]   # tune the launch configs

One JSON line per (shape, M): the time in microseconds of
- ``path1_us``: the weight-only path (``gemm.w8a16_linear``: GEMV kernel at M <= GEMV_MAX_M, tl.dot above),
- ``path2_triton_us``: the W8A8 path with the Triton GEMM (quantize launch + int8 tl.dot GEMM),
- ``path2_int_mm_us``: the W8A8 path with torch._int_mm (quantize + cuBLASLt + Triton rescale; M > 16),
- ``bf16_us``: ``F.linear`` on the bf16 weight,
the achieved GB/s of each (weight + activation + output bytes over the time), the weight-only
launch config, and which path ``int8_linear`` takes at this M today. A last line per shape names
the smallest M at which path 2 beats path 1: ``gemm.WEIGHT_ONLY_MAX_M`` should sit just below it
(and be a size the CUDA graph runner captures: 1, 2, 4, 8 or a multiple of 8 up to 256).

Each timing replays a CUDA graph of 20 calls (decode runs under graphs, so launch overhead is not
counted) cycling over enough copies of the weight to overflow the L2 cache, as a model's layers do.

``--sweep`` times a grid of launch configs per (shape, M) for the kernel each path uses at that M
(GEMV, tl.dot weight-only, int8 GEMM) and prints the default's time and the best config; the
defaults live in ``kernels_w8a16`` (module constants, ``w8a16_config``) and
``kernels_w8a8.gemm_config``. About 36 configs per kernel, mostly compile time: minutes per shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from engine_quant_int8 import gemm, kernels_w8a8
from engine_quant_int8.kernels_w8a16 import w8a16_config, w8a16_linear_triton
from engine_quant_int8.quantize import quantize_per_channel

LLAMA_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CALLS_PER_GRAPH = 20
L2_OVERFLOW_BYTES = 256 << 20


def time_us(fns: list[Callable[[], object]]) -> float:
    """Median microseconds per call of a graph that calls ``fns`` round-robin CALLS_PER_GRAPH times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()  # compile and allocate outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(CALLS_PER_GRAPH):
            fns[i % len(fns)]()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    samples.sort()
    return samples[len(samples) // 2]


def bench_shape(name: str, k: int, n: int, ms: list[int]) -> None:
    dev = torch.device("cuda")
    copies = max(1, math.ceil(L2_OVERFLOW_BYTES / (n * k * 2)))
    w_bf16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    w_int8 = [quantize_per_channel(w) for w in w_bf16]
    sms = gemm.num_sms(dev)
    switch = None
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        io_bytes = m * k * 2 + m * n * 2
        row: dict[str, object] = {"shape": name, "k": k, "n": n, "m": m,
                                  "int8_linear_path": "weight_only" if m <= gemm.WEIGHT_ONLY_MAX_M else "w8a8",
                                  "path1_config": w8a16_config(m, n, k, m <= gemm.GEMV_MAX_M, sms, x.dtype)}
        times = {
            "path1_us": time_us([lambda q=q, s=s, x=x: gemm.w8a16_linear(x, q, s) for q, s in w_int8]),
            "path2_triton_us": _path2(x, w_int8, "triton"),
            "path2_int_mm_us": _path2(x, w_int8, "int_mm") if m > 16 else None,
            "bf16_us": time_us([lambda w=w, x=x: F.linear(x, w) for w in w_bf16]),
        }
        for key, us in times.items():
            row[key] = None if us is None else round(us, 2)
            weight_bytes = n * k * (2 if key == "bf16_us" else 1)
            row[key.replace("_us", "_gbps")] = None if us is None else round((weight_bytes + io_bytes) / us / 1e3, 1)
        path2 = min(t for t in (times["path2_triton_us"], times["path2_int_mm_us"]) if t is not None)
        if switch is None and path2 < times["path1_us"]:
            switch = m
        print(json.dumps(row), flush=True)
    print(json.dumps({"shape": name, "first_m_where_path2_wins": switch}), flush=True)


def _path2(x: torch.Tensor, w_int8: list[tuple[torch.Tensor, torch.Tensor]], variant: str) -> float:
    saved = gemm.LARGE_M_GEMM
    gemm.LARGE_M_GEMM = variant
    try:
        return time_us([lambda q=q, s=s, x=x: gemm.w8a8_linear(x, q, s) for q, s in w_int8])
    finally:
        gemm.LARGE_M_GEMM = saved


def _candidates(kernel: str) -> list[dict[str, int]]:
    if kernel == "gemv":
        grid = itertools.product([8, 16, 32], [256, 512, 1024], [1, 2], [4, 8])
        return [{"BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": w, "num_stages": 1}
                for bn, bk, sk, w in grid]
    if kernel == "dot":
        grid = itertools.product([16, 32, 64], [128, 256], [1, 2, 4], [3, 4])
        return [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": 4, "num_stages": st}
                for bn, bk, sk, st in grid]
    grid = itertools.product([64, 128], [64, 128, 256], [64, 128], [(4, 3), (8, 3), (8, 4)])
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": w, "num_stages": st}
            for bm, bn, bk, (w, st) in grid]


def sweep_shape(name: str, k: int, n: int, ms: list[int]) -> None:
    dev = torch.device("cuda")
    copies = max(1, math.ceil(L2_OVERFLOW_BYTES / (n * k)))
    w_int8 = [quantize_per_channel(torch.randn(n, k, device=dev) * k ** -0.5) for _ in range(copies)]
    sms = gemm.num_sms(dev)
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        kernels = ["gemv" if m <= gemm.GEMV_MAX_M else "dot", "w8a8_gemm"]
        if m <= 4 and m > gemm.GEMV_MAX_M:
            kernels.append("gemv")
        for kernel in kernels:
            if kernel == "w8a8_gemm":
                qx, sx = kernels_w8a8.quantize_per_token(x)
                default = kernels_w8a8.gemm_config(m, n, sms)

                def run(cfg: dict[str, int], q: torch.Tensor, s: torch.Tensor, qx: torch.Tensor = qx,
                        sx: torch.Tensor = sx) -> object:
                    return kernels_w8a8.w8a8_gemm(qx, sx, q, s, None, torch.bfloat16, sms, cfg)
            else:
                default = w8a16_config(m, n, k, kernel == "gemv", sms, x.dtype)
                block_m = default["BLOCK_M"]

                def run(cfg: dict[str, int], q: torch.Tensor, s: torch.Tensor, kernel: str = kernel,
                        block_m: int = block_m, x: torch.Tensor = x) -> object:
                    return w8a16_linear_triton(x, q, s, None, kernel == "gemv", sms, {"BLOCK_M": block_m, **cfg})
            results = []
            for cfg in [default, *_candidates(kernel)]:
                try:
                    us = time_us([lambda q=q, s=s, cfg=cfg, run=run: run(cfg, q, s) for q, s in w_int8])
                except Exception as exc:  # a config the GPU cannot hold (shared memory, registers)
                    results.append((math.inf, cfg, type(exc).__name__))
                    continue
                results.append((us, cfg, None))
            best = min(results, key=lambda r: r[0])
            print(json.dumps({"shape": name, "m": m, "kernel": kernel, "default_us": round(results[0][0], 2),
                              "default": default, "best_us": round(best[0], 2), "best": best[1],
                              "failed_configs": sum(r[2] is not None for r in results)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="1,2,4,8,16,32,64,128,256", help="token counts, comma-separated")
    parser.add_argument("--shapes", default=",".join(LLAMA_8B), help=f"of {', '.join(LLAMA_8B)}")
    parser.add_argument("--sweep", action="store_true", help="tune launch configs instead of comparing paths")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "WEIGHT_ONLY_MAX_M": gemm.WEIGHT_ONLY_MAX_M, "GEMV_MAX_M": gemm.GEMV_MAX_M,
                      "LARGE_M_GEMM": gemm.LARGE_M_GEMM}), flush=True)
    with torch.inference_mode():
        for name in args.shapes.split(","):
            (sweep_shape if args.sweep else bench_shape)(name, *LLAMA_8B[name], [int(m) for m in args.m.split(",")])


if __name__ == "__main__":
    main()
