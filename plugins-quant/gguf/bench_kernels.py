"""Micro-benchmark of the GGUF dequantize-GEMM against bf16 ``F.linear`` (CUDA GPU).

One JSON line per (type, shape, M): the kernel's time, bf16 F.linear's time on the same shape,
and the kernel's achieved bandwidth (block bytes + activations + output over its time).
Shapes: Llama-3-8B's linears (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096)
at M = 1, 16, 64, 256.

    python plugins-quant/gguf/bench_kernels.py [--types Q4_K,Q6_K] [--m 1,16] [--sweep]

``--sweep`` also times every (BLOCK_N, SPLIT_K) of the M = 1 kernel and prints the best per shape
(to tune ``kernels.gemv_config``).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    """Median microseconds of ``fn`` replayed in a CUDA graph (launch overhead as in serving)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1000 / 10


def main() -> None:
    from engine_quant_gguf import formats, kernels

    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0,Q4_1")
    parser.add_argument("--m", default="1,16,64,256")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tname in args.types.split(","):
        qtype = formats.type_from_name(tname)
        for shape, (n, k) in SHAPES.items():
            blocks = formats.random_blocks(n, k, qtype, gen, torch.device("cuda"))
            dense = formats.dequantize(blocks, qtype).bfloat16()
            for m in (int(v) for v in args.m.split(",")):
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                t_kernel = _time(lambda: kernels.gguf_matmul(x, blocks, qtype, n, out=out))
                t_bf16 = _time(lambda: F.linear(x, dense))
                moved = blocks.numel() + x.numel() * 2 + out.numel() * 2
                row = {"type": tname, "shape": shape, "n": n, "k": k, "m": m, "kernel_us": round(t_kernel, 2),
                       "bf16_linear_us": round(t_bf16, 2), "speedup": round(t_bf16 / t_kernel, 2),
                       "kernel_gbps": round(moved / t_kernel / 1e3, 1), "config": list(
                           kernels.gemv_config(n, k, qtype, kernels._sm_count(0)) if m == 1
                           else kernels.gemm_config(m, n, qtype))}
                print(json.dumps(row), flush=True)
            if args.sweep:
                _sweep(tname, qtype, shape, n, k, blocks)


def _sweep(tname: str, qtype: int, shape: str, n: int, k: int, blocks: torch.Tensor) -> None:
    from engine_quant_gguf import kernels

    x = torch.randn(1, k, device="cuda").bfloat16()
    units = -(-k // 256)
    results = []
    original = kernels.gemv_config
    for block_n in (4, 8, 16, 32, 64):
        for split in (s for s in (1, 2, 4, 7, 8, 14, 16) if units % s == 0 and units // s >= 1):
            for warps in (2, 4, 8):
                kernels.gemv_config = lambda *_a, b=block_n, s=split, w=warps: (b, s, w)  # type: ignore[misc]
                try:
                    results.append((_time(lambda: kernels.gguf_matmul(x, blocks, qtype, n)), block_n, split, warps))
                finally:
                    kernels.gemv_config = original
    best = sorted(results)[:3]
    print(json.dumps({"sweep": tname, "shape": shape, "m": 1, "best_us_block_n_split_warps": best}), flush=True)


if __name__ == "__main__":
    main()
