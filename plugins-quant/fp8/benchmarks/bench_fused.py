"""Times the fp8 fp8xfp8 path at batch-sized M with and without producer-fused quantization.

    python plugins-quant/fp8/benchmarks/bench_fused.py [--ms 48,64,128] [--sweep]

Per Llama-3-8B linear and M: bf16 F.linear, the default w8a8 path (quantization launch + GEMM),
the GEMM alone on pre-quantized activations (what runs after a fused producer), and with --sweep the
best few (BLOCK_N, SPLIT_K, num_stages) configs of that GEMM. Then the producers: RMSNorm and
SiLU-and-mul unfused (+ the separate quantization launch) against the fused kernels. One JSON line
each; GPU microseconds from CUDA graphs over weight copies larger than L2 (bench_kernels.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kernels import SHAPES, _Operands, _spin_up, _time_us  # noqa: E402


def _grid() -> list[dict[str, int]]:
    out = []
    for bn, split, stages in itertools.product((32, 64, 128), (1, 2, 4), (3, 4, 5)):
        out.append({"BLOCK_M": 64, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
                    "num_stages": stages, "SPLIT_K": split})
    return out


#: (BLOCK, num_warps) of the SiLU-and-mul quantization timed by --producers-only (d = 14336:
#: BLOCK 16384 is one pass from registers, smaller blocks the two-pass kernel).
SILU_CONFIGS = ((16384, 8), (16384, 32), (8192, 8), (4096, 8), (2048, 4))


def main() -> None:
    import torch
    import torch.nn.functional as F
    from engine_platform_cuda.kernels import rms_norm, silu_and_mul
    from engine_quant_fp8 import fused
    from engine_quant_fp8.kernels import quantize_per_token_triton
    from engine_quant_fp8.w8a8 import w8a8_gemm, w8a8_linear

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="48,64,128")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--producers-only", action="store_true",
                        help="only the producers, and the SiLU-and-mul quantization at SILU_CONFIGS")
    args = parser.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    _spin_up()
    for name, (n, k) in () if args.producers_only else SHAPES.items():
        ops = _Operands(n, k)
        for m in ms:
            x = ops.x(m)
            qx, sx = quantize_per_token_triton(x)
            row = {"shape": name, "m": m,
                   "bf16_us": round(_time_us(lambda i: F.linear(x, ops.bf16[i]), ops.copies), 2),
                   "w8a8_us": round(_time_us(lambda i: w8a8_linear(x, *ops.fp8[i]), ops.copies), 2),
                   "gemm_prequant_us": round(_time_us(lambda i: w8a8_gemm(qx, sx, *ops.fp8[i], None, x.dtype),
                                                      ops.copies), 2)}
            if args.sweep:
                results = []
                for cfg in _grid():
                    try:
                        us = _time_us(lambda i, c=cfg: w8a8_gemm(qx, sx, *ops.fp8[i], None, x.dtype, config=c),
                                      ops.copies, reps=3)
                    except Exception:  # noqa: BLE001 - out of shared memory
                        continue
                    results.append((round(us, 2), {kk: cfg[kk] for kk in ("BLOCK_N", "SPLIT_K", "num_stages")}))
                row["best"] = sorted(results, key=lambda r: r[0])[:4]
            print(json.dumps(row), flush=True)
        del ops
        torch.cuda.empty_cache()
    for m in ms:
        h = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(h)
        w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
        gu = torch.randn(m, 28672, device="cuda", dtype=torch.bfloat16)
        row = {"producers_m": m,
               "rms_norm_then_quant_us": round(_time_us(lambda i: quantize_per_token_triton(rms_norm(h, w, 1e-5, r)[0]),
                                                        4), 2),
               "rms_norm_quant_fused_us": round(_time_us(lambda i: fused.rms_norm_quant(h, w, 1e-5, r), 4), 2),
               "silu_then_quant_us": round(_time_us(lambda i: quantize_per_token_triton(silu_and_mul(gu)), 4), 2),
               "silu_quant_fused_us": round(_time_us(lambda i: fused.silu_and_mul_quant(gu), 4), 2),
               "silu_quant_read_bound_us": round(m * 28672 * 2.5 / 4.29e6, 2)}  # gate/up read, codes written
        for block, warps in SILU_CONFIGS if args.producers_only else ():
            row[f"silu_quant_b{block}_w{warps}_us"] = round(_time_us(
                lambda i, b=block, w=warps: fused.silu_and_mul_quant(gu, block=b, num_warps=w), 4), 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
