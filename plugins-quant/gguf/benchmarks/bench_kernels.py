"""Micro-benchmark of the GGUF kernels against bf16 ``F.linear`` (CUDA GPU).

One JSON line per (type, shape, M): the default path's time (GEMV at M <= 2, the tl.dot GEMM up
to ``GEMM_MAX_M``, dequantize + cuBLAS above), bf16 ``F.linear``'s time on the same shape, the
dequantize + cuBLAS time (M >= 3) and the kernel's achieved bandwidth (weight bytes in the planes
layout + activations + output over its time). Shapes: Llama-3-8B's linears (qkv 4096->6144,
o 4096->4096, gate_up 4096->28672, down 14336->4096).

    python plugins-quant/gguf/benchmarks/bench_kernels.py [--types Q4_K,Q6_K] [--m 1,2,16,64,256] [--shapes qkv,o]
                                               [--sweep] [--rep-ms 30]

``--sweep`` also times a handful of GEMV configs (BN, NU, SPLIT, num_warps) at M = 1 and GEMM
configs (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages) at M = 16 and 64, to tune
``kernels.gemv_config`` / ``gemm_config`` / ``GEMM_MAX_M``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
REP_MS = 30


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    """Median microseconds of ``fn`` replayed in a CUDA graph (launch overhead as in serving)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=REP_MS, return_mode="median") * 1000 / 10


def _splits(units: int, programs: int, sms: int) -> int:
    if programs >= 2 * sms:
        return 1
    want = -(-2 * sms // programs)
    return max(s for s in range(1, min(want, units) + 1) if units % s == 0)


def main() -> None:
    global REP_MS
    from engine_quant_gguf import formats, kernels

    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0,Q4_1")
    parser.add_argument("--m", default="1,2,16,64,256")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rep-ms", type=int, default=REP_MS)
    args = parser.parse_args()
    REP_MS = args.rep_ms
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = kernels._sm_count(0)
    for tname in args.types.split(","):
        qtype = formats.type_from_name(tname)
        for shape, (n, k) in SHAPES.items():
            if shape not in args.shapes.split(","):
                continue
            raw = formats.random_blocks(n, k, qtype, gen, torch.device("cuda"))
            dense = formats.dequantize(raw, qtype).bfloat16()
            planes = formats.pack(raw, qtype)
            del raw
            for m in (int(v) for v in args.m.split(",")):
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                got = kernels.gguf_matmul(x, planes, qtype, n, out=out)
                err = ((got.double() - x.double() @ dense.double().T).norm() / (x.double() @ dense.double().T).norm())
                t_kernel = _time(lambda: kernels.gguf_matmul(x, planes, qtype, n, out=out))
                t_bf16 = _time(lambda: F.linear(x, dense))
                moved = planes.numel() + x.numel() * 2 + out.numel() * 2
                path = ("gemv" if m <= kernels.GEMV_MAX_M else "gemm"
                        if m <= kernels.GEMM_MAX_M.get(qtype, kernels.GEMM_MAX_M_DEFAULT) else "dense")
                row = {"type": tname, "shape": shape, "n": n, "k": k, "m": m, "path": path,
                       "kernel_us": round(t_kernel, 2), "bf16_linear_us": round(t_bf16, 2),
                       "speedup": round(t_bf16 / t_kernel, 2), "kernel_gbps": round(moved / t_kernel / 1e3, 1),
                       "rel_err_vs_bf16_weights": float(f"{err.item():.2e}"),
                       "weight_mb": round(planes.numel() / 1e6, 2), "bf16_weight_mb": round(dense.numel() * 2 / 1e6, 2)}
                if m >= 3:
                    row["dense_us"] = round(_time(lambda: kernels.gguf_matmul(x, planes, qtype, n, out=out,
                                                                              path="dense")), 2)
                print(json.dumps(row), flush=True)
            if args.sweep:
                _sweep(tname, qtype, shape, n, k, planes, sms)
            del dense, planes


def _sweep(tname: str, qtype: int, shape: str, n: int, k: int, planes: torch.Tensor, sms: int) -> None:
    from engine_quant_gguf import kernels

    units = kernels._units(qtype, k)
    x1 = torch.randn(1, k, device="cuda").bfloat16()
    res = []
    for bn, nu, warps in ((4, 32, 4), (8, 32, 8), (2, 32, 2), (4, 64, 4), (8, 32, 4)):
        if units % nu and units > nu:
            continue
        for split in sorted({1, _splits(units, -(-n // bn), sms)}):
            cfg = (bn, nu, split, warps)
            try:
                res.append((round(_time(lambda: kernels.gguf_matmul(x1, planes, qtype, n, path="gemv", config=cfg)),
                                  2), list(cfg)))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                res.append((1e9, f"{cfg}: {type(exc).__name__}"))
    res.sort(key=lambda r: r[0])
    print(json.dumps({"sweep": "gemv", "type": tname, "shape": shape, "m": 1,
                      "default": list(kernels.gemv_config(qtype, 1, n, k, sms)), "us_config": res}), flush=True)
    for m in (16, 64):
        x = torch.randn(m, k, device="cuda").bfloat16()
        res = []
        for bm, bn, bk, warps, stages in ((16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3),
                                          (32, 64, 128, 4, 3), (64, 64, 128, 4, 3), (64, 128, 64, 8, 3)):
            if bm > max(16, m) or k % bk:
                continue
            steps = k // bk
            tiles = -(-n // bn) * -(-m // bm)
            for split in sorted({1, _splits(steps, tiles, sms // 2)}):
                cfg = (bm, bn, bk, split, warps, stages)
                try:
                    res.append((round(_time(lambda: kernels.gguf_matmul(x, planes, qtype, n, path="gemm",
                                                                        config=cfg)), 2), list(cfg)))
                except Exception as exc:  # noqa: BLE001
                    res.append((1e9, f"{cfg}: {type(exc).__name__}"))
        res.sort(key=lambda r: r[0])
        print(json.dumps({"sweep": "gemm", "type": tname, "shape": shape, "m": m,
                          "default": list(kernels.gemm_config(qtype, m, n, k, sms)), "us_config": res}), flush=True)


if __name__ == "__main__":
    main()
