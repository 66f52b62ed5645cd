"""Micro-benchmark of the GGUF dequantize-GEMM against bf16 ``F.linear`` (CUDA GPU).

One JSON line per (type, shape, M): the kernel's time, bf16 F.linear's time on the same shape,
and the kernel's achieved bandwidth (block bytes + activations + output over its time).
Shapes: Llama-3-8B's linears (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096)
at M = 1, 16, 64, 256.

    python plugins-quant/gguf/bench_kernels.py [--types Q4_K,Q6_K] [--m 1,16] [--shapes qkv,o] [--sweep]

``--sweep`` also times (R, SPLIT_K, num_warps) of the rows kernel at M = 1 (to tune
``kernels.rows_config``), and the rows kernel against dequantize + cuBLAS
at M = 2..16 (to place ``kernels.DENSE_MIN_M``).
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
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1000 / 10


def main() -> None:
    from engine_quant_gguf import formats, kernels

    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0,Q4_1")
    parser.add_argument("--m", default="1,16,64,256")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tname in args.types.split(","):
        qtype = formats.type_from_name(tname)
        for shape, (n, k) in SHAPES.items():
            if shape not in args.shapes.split(","):
                continue
            raw = formats.random_blocks(n, k, qtype, gen, torch.device("cuda"))
            dense = formats.dequantize(raw, qtype).bfloat16()
            blocks = formats.pack(raw, qtype)
            for m in (int(v) for v in args.m.split(",")):
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                t_kernel = _time(lambda: kernels.gguf_matmul(x, blocks, qtype, n, out=out))
                t_bf16 = _time(lambda: F.linear(x, dense))
                moved = blocks.numel() + x.numel() * 2 + out.numel() * 2
                row = {"type": tname, "shape": shape, "n": n, "k": k, "m": m, "kernel_us": round(t_kernel, 2),
                       "bf16_linear_us": round(t_bf16, 2), "speedup": round(t_bf16 / t_kernel, 2),
                       "kernel_gbps": round(moved / t_kernel / 1e3, 1), "config": _config(kernels, m, n, k, qtype)}
                print(json.dumps(row), flush=True)
            if args.sweep:
                _sweep(tname, qtype, shape, n, k, blocks, dense)


def _config(kernels, m: int, n: int, k: int, qtype: int) -> object:  # type: ignore[no-untyped-def]
    if m >= kernels.DENSE_MIN_M.get(qtype, kernels.DENSE_MIN_M_DEFAULT):
        return "dequantize+cuBLAS"
    return list(kernels.rows_config(qtype, m, n, k, kernels._sm_count(0)))


def _sweep(tname: str, qtype: int, shape: str, n: int, k: int, blocks: torch.Tensor, dense: torch.Tensor) -> None:
    """Times (R, num_warps) of the rows kernel at M = 1 (SPLIT_K by rows_config's rule), and at
    M = 2..16 the rows kernel against dequantize + cuBLAS (to place ``DENSE_MIN_M``)."""
    from engine_quant_gguf import kernels

    original, switch = kernels.rows_config, dict(kernels.DENSE_MIN_M)
    sms = kernels._sm_count(0)
    units = -(-k // 256)
    x1 = torch.randn(1, k, device="cuda").bfloat16()
    results = []
    for r, warps in ((1, 4), (2, 4), (4, 4), (2, 2), (4, 2), (8, 2)):
        tiles = -(-n // (r * 32 * warps))
        want = max(1, -(-4 * sms // tiles))
        split = max(s for s in range(1, min(want, units) + 1) if units % s == 0)
        kernels.rows_config = lambda *_a, r=r, s=split, w=warps: (1, r, s, w)  # type: ignore[misc]
        try:
            results.append((round(_time(lambda: kernels.gguf_matmul(x1, blocks, qtype, n)), 2), r, split, warps))
        finally:
            kernels.rows_config = original
    results.sort()
    print(json.dumps({"sweep": tname, "shape": shape, "m": 1, "default": list(original(qtype, 1, n, k, sms)),
                      "us_r_split_warps": results}), flush=True)
    for m in (2, 4, 8, 16):
        x = torch.randn(m, k, device="cuda").bfloat16()
        row: dict[str, object] = {"switch": tname, "shape": shape, "m": m}
        kernels.DENSE_MIN_M[qtype] = 10 ** 9
        row["rows_kernel_us"] = round(_time(lambda: kernels.gguf_matmul(x, blocks, qtype, n)), 2)
        kernels.DENSE_MIN_M[qtype] = 1
        row["dense_us"] = round(_time(lambda: kernels.gguf_matmul(x, blocks, qtype, n)), 2)
        kernels.DENSE_MIN_M.clear()
        kernels.DENSE_MIN_M.update(switch)
        row["bf16_us"] = round(_time(lambda: F.linear(x, dense)), 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
