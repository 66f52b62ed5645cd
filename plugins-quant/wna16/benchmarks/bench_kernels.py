"""Micro-benchmark of the W4A16 dequantize-GEMV/GEMM on a CUDA GPU (run by hand, not a test).

One JSON line per (linear, M): the kernel's time, bf16 ``F.linear`` on the same shape, the
speed-up and the kernel's achieved bandwidth (packed weights + scales + zeros + activations +
output). Shapes: the Llama-3-8B linears at M = 1, 2, 4, 16, 64, 256; each line names the path
``choose_config`` takes (``path``: gemv, gemm or dequant). Timed with CUDA graphs
(``triton.testing.do_bench_cudagraph``), as the engine's decode runs.

    python plugins-quant/wna16/benchmarks/bench_kernels.py                       # AWQ-like: 4-bit, groups of 128, zeros
    python plugins-quant/wna16/benchmarks/bench_kernels.py --symmetric --act-order   # GPTQ act-order
    python plugins-quant/wna16/benchmarks/bench_kernels.py --alts                # also a few alternatives per M
    python plugins-quant/wna16/benchmarks/bench_kernels.py --sweep               # also every alternative tile config
    python plugins-quant/wna16/benchmarks/bench_kernels.py --alts --warm --shapes down   # compile only (fills
        Triton's cache; run one per shape in parallel, then the timing run compiles nothing)

Each line also gives ``rel_err``: the relative L2 error of the kernel's output against the
float32 reference (``wna16_linear_torch``), so a wrong fast kernel shows.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from engine_quant_wna16.kernels import KernelConfig, choose_config, gemm_config, wna16_gemm
from engine_quant_wna16.layout import to_kernel_layout, wna16_linear_torch
from engine_quant_wna16.rtn import act_order_g_idx, quantize_rtn

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
BATCHES = (1, 2, 4, 16, 64, 256)


_REP_MS = 50


def _time_ms(fn) -> float:  # type: ignore[no-untyped-def]
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=_REP_MS)
    except Exception:  # noqa: BLE001 - fall back where graph capture is unavailable
        return triton.testing.do_bench(fn, warmup=20, rep=100)


def _focused(m: int, n: int, k: int, group: int) -> list[KernelConfig]:
    """A handful of alternatives per M (``--alts``): GEMV tiles at M = 1, fused-GEMM tiles (K split
    for the shape) above, dequantize + cuBLAS from M = 64."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if m == 1:
        return [KernelConfig("gemv", 1, bn, bk, 4, 1) for bn, bk in ((16, 2048), (16, 4096), (8, 2048))] + [
            gemm_config(m, n, k, group, 16, 128, 128, 8, 4, sms)]
    if m <= 4:
        return [KernelConfig("gemv", triton.next_power_of_2(m), 8, 1024, 4, 1), gemm_config(m, n, k, group, 16, 64, 128, 4, 4, sms)]
    if m <= 16:
        return [gemm_config(m, n, k, group, 16, bn, bk, w, s, sms, sf) for bn, bk, w, s, sf in
                ((64, 128, 4, 4, False), (128, 128, 8, 3, False), (128, 64, 8, 4, False), (256, 128, 8, 3, False),
                 (128, 128, 8, 4, True))]
    if m <= 64:
        return [gemm_config(m, n, k, group, bm, bn, bk, w, s, sms, sf) for bm, bn, bk, w, s, sf in
                ((64, 64, 128, 4, 4, False), (64, 128, 128, 8, 4, False), (64, 128, 64, 8, 4, False),
                 (32, 128, 128, 8, 3, False), (64, 128, 128, 8, 3, True))] + [KernelConfig("dequant", 1, 16, 512, 4, 1)]
    return [gemm_config(m, n, k, group, bm, bn, bk, w, s, sms, sf) for bm, bn, bk, w, s, sf in
            ((64, 128, 128, 8, 3, False), (128, 64, 128, 4, 3, False), (128, 128, 64, 8, 4, False),
             (128, 128, 128, 8, 3, True))] + [KernelConfig("dequant", 1, 16, 512, 4, 1)]


def _alternatives(m: int, n: int, k: int, group: int) -> list[KernelConfig]:
    """Tile configs the kernels accept for ``m`` rows and groups of ``group`` inputs (``--sweep``)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = []
    if m <= 2:
        for bn in (8, 16, 32):
            for bk in (1024, 2048, 4096):
                configs += [KernelConfig("gemv", triton.next_power_of_2(m), bn, bk, w, 1) for w in (4, 8)]
    if m > 1:
        block_ms = (16,) if m <= 16 else (32, 64) if m <= 64 else (64, 128, 256)
        for bm in block_ms:
            for bn in (64, 128):
                for bk in (64, 128, 256):
                    for w, s in ((4, 3), (4, 4), (8, 3)):
                        configs += [gemm_config(m, n, k, group, bm, bn, bk, w, s, sms, sf) for sf in (False, True)]
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--symmetric", action="store_true", help="no zero points (GPTQ sym)")
    parser.add_argument("--act-order", action="store_true", help="GPTQ desc_act: activations gathered by perm")
    parser.add_argument("--sweep", action="store_true", help="time every alternative tile config too")
    parser.add_argument("--alts", action="store_true", help="time a few alternatives per M too")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--brief", action="store_true", help="one short text line per measurement")
    parser.add_argument("--rep-ms", type=int, default=50, help="timing window per measurement")
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    parser.add_argument("--warm", action="store_true", help="compile (run once) every config, time nothing")
    args = parser.parse_args()
    dev = torch.device("cuda")
    global _REP_MS
    _REP_MS = args.rep_ms
    for name in args.shapes:
        k, n = SHAPES[name]
        weight = torch.randn(n, k, device=dev) * 0.02
        group = k if args.group_size == -1 else args.group_size
        g_idx = act_order_g_idx(k, group).to(dev) if args.act_order else None
        kw = to_kernel_layout(quantize_rtn(weight, args.bits, args.group_size, args.symmetric, g_idx), name)
        dense = weight.to(torch.bfloat16)
        weight_bytes = (kw.qweight.numel() * 4 + kw.scales.numel() * kw.scales.element_size()
                        + (kw.zeros.numel() * kw.zeros.element_size() if kw.zeros is not None else 0))
        for m in args.batches:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            if args.warm:
                for cfg in dict.fromkeys([choose_config(m, n, k, kw.group_size, dev),
                                          *(_focused(m, n, k, kw.group_size) if args.alts else [])]):
                    try:
                        wna16_gemm(x, kw, config=cfg)
                    except Exception as exc:  # noqa: BLE001
                        print(json.dumps({"linear": name, "m": m, "config": cfg.__dict__, "error": str(exc)[:200]}))
                torch.cuda.synchronize()
                continue
            bf16_ms = _time_ms(lambda: F.linear(x, dense))
            chosen = choose_config(m, n, k, kw.group_size, dev)
            alts = _alternatives(m, n, k, kw.group_size) if args.sweep else _focused(m, n, k, kw.group_size) if args.alts else []
            configs = [chosen] + [c for c in alts if c != chosen]
            want = wna16_linear_torch(x.float(), kw)
            for cfg in configs:
                try:
                    got = wna16_gemm(x, kw, config=cfg).float()
                    rel = float((got - want).norm() / want.norm())
                    ms = _time_ms(lambda cfg=cfg: wna16_gemm(x, kw, config=cfg))
                except Exception as exc:  # noqa: BLE001 - a config the compiler rejects (shared memory)
                    print(json.dumps({"linear": name, "m": m, "config": cfg.__dict__, "error": str(exc)[:200]}))
                    continue
                moved = weight_bytes + m * k * 2 + m * n * 2
                if args.brief:
                    print(f"{name:8s} m={m:<4d} {'*' if cfg == chosen else ' '}{cfg.kind:7s} bm={cfg.block_m:<3d} "
                          f"bn={cfg.block_n:<3d} bk={cfg.block_k:<5d} w={cfg.num_warps}{'f' if cfg.x_f32 else ' '} "
                          f"s={cfg.num_stages} sk={cfg.split_k} {'sf' if cfg.scale_first else '  '} {ms * 1e3:8.2f} us "
                          f"bf16 {bf16_ms * 1e3:8.2f} x{bf16_ms / ms:5.2f} {moved / (ms * 1e-3) / 1e9:7.1f} GB/s "
                          f"err {rel:.1e}", flush=True)
                    continue
                print(json.dumps({
                    "linear": name, "m": m, "k": k, "n": n, "bits": args.bits, "group_size": args.group_size,
                    "symmetric": args.symmetric, "act_order": args.act_order, "chosen": cfg == chosen, "path": cfg.kind,
                    "config": cfg.__dict__, "kernel_us": round(ms * 1e3, 2), "bf16_linear_us": round(bf16_ms * 1e3, 2),
                    "speedup_vs_bf16": round(bf16_ms / ms, 2), "kernel_gb_s": round(moved / (ms * 1e-3) / 1e9, 1),
                    "rel_err": float(f"{rel:.2e}"),
                }), flush=True)


if __name__ == "__main__":
    main()
