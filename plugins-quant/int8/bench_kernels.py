"""Micro-benchmark of the w8a8_int8 kernels at the Llama-3-8B linear shapes (needs a CUDA GPU).

    python plugins-quant/int8/bench_kernels.py [--m 1,2,4,8,16,32,64,128,256] [--shapes qkv,o,gate_up,down]

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
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from engine_quant_int8 import gemm
from engine_quant_int8.kernels_w8a16 import w8a16_config
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="1,2,4,8,16,32,64,128,256", help="token counts, comma-separated")
    parser.add_argument("--shapes", default=",".join(LLAMA_8B), help=f"of {', '.join(LLAMA_8B)}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "WEIGHT_ONLY_MAX_M": gemm.WEIGHT_ONLY_MAX_M, "GEMV_MAX_M": gemm.GEMV_MAX_M,
                      "LARGE_M_GEMM": gemm.LARGE_M_GEMM}), flush=True)
    with torch.inference_mode():
        for name in args.shapes.split(","):
            bench_shape(name, *LLAMA_8B[name], [int(m) for m in args.m.split(",")])


if __name__ == "__main__":
    main()
