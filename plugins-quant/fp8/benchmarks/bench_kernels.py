"""Micro-benchmark of the fp8 plugin's GEMM paths on the Llama-3-8B linear shapes (needs a CUDA GPU).

    python plugins-quant/fp8/benchmarks/bench_kernels.py                 # one JSON line per (shape, M)
    python plugins-quant/fp8/benchmarks/bench_kernels.py --sweep 120     # tune launch configs (seconds per shape)
    python plugins-quant/fp8/benchmarks/bench_kernels.py --large 1024,8192  # fp8 x fp8 GEMMs at batch/prefill M

``--large``: per shape and M, TFLOPS and the fraction of the dense peak (``--peak-fp8``,
``--peak-bf16``) of bf16 ``F.linear``, ``torch._scaled_mm`` on activations already quantized (what
a layer with a fused producer runs), the same with ``use_fast_accum`` (both products' relative L2
error against float32 maths on the same codes), the per-token quantization launch alone, and the Triton fp8 x
fp8 GEMM at its default config and at the ``LARGE_CONFIGS`` tiles.

Each line: the time of ``fp8_linear`` as dispatched (``fp8_us``, ``path``), of bf16 ``F.linear``
on the same shape (``bf16_us``), the GB/s achieved over the bytes each must read (weights +
activations + output), and the candidate paths: the weight-only Triton kernel (per-channel and
128x128 block scales), per-token quant (Triton) + ``torch._scaled_mm``, and the old torch-op quant
+ ``torch._scaled_mm``. Times are GPU times of a CUDA graph replaying the op over several weight
copies (more than L2 holds), so launch overhead and L2 reuse flatter nothing, as in decode.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 16, 64, 256)
SWEEP_MS = (1, 4, 8, 16, 32, 64, 128, 256)
_ROTATE_BYTES = 256 << 20  # weight copies per graph: more than the H100's 50 MB L2


def _time_us(fn: Callable[[int], Any], copies: int, reps: int = 5) -> float:
    """Median GPU microseconds of one ``fn(i)``, from a CUDA graph of ``fn`` over all copies."""
    import functools

    from engine_platform_cuda.graph_timing import graph_median_us

    return graph_median_us([functools.partial(fn, i) for i in range(copies)], reps=reps)


def _spin_up() -> None:
    """A few hundred ms of dense work, so the GPU's clocks are up before the first timing."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(40):
        a @ a
    torch.cuda.synchronize()


class _Operands:
    """Weight copies of one shape in every layout the paths need."""

    def __init__(self, n: int, k: int) -> None:
        import torch
        from engine_quant_fp8.quantize import quantize_per_block, quantize_per_channel

        self.n, self.k = n, k
        self.copies = max(2, min(16, _ROTATE_BYTES // (n * k)))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        q, s = quantize_per_channel(w)
        qb, sb = quantize_per_block(w)
        self.bf16 = [w.clone() for _ in range(self.copies)]
        self.fp8 = [(q.clone(), s.clone()) for _ in range(self.copies)]
        self.block = [(qb.clone(), sb.clone()) for _ in range(self.copies)]
        del w

    def x(self, m: int) -> Any:
        import torch

        return torch.randn(m, self.k, device="cuda", dtype=torch.bfloat16)


def _gbps(n: int, k: int, m: int, weight_bytes: int, us: float) -> float:
    return round((n * k * weight_bytes + 2 * m * (k + n)) / (us * 1e-6) / 1e9, 1)


def run_default(ms: tuple[int, ...]) -> None:
    import torch
    import torch.nn.functional as F
    from engine_quant_fp8 import gemm
    from engine_quant_fp8.kernels import w8a16_linear
    from engine_quant_fp8.quantize import quantize_per_token_reference
    from engine_quant_fp8.w8a8 import w8a8_linear

    def old_path(x: Any, q: Any, s: Any) -> Any:
        qx, sx = quantize_per_token_reference(x)
        return torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=s[None, :], out_dtype=x.dtype)

    for name, (n, k) in SHAPES.items():
        ops = _Operands(n, k)
        _spin_up()
        for m in ms:
            x = ops.x(m)
            row: dict[str, Any] = {"shape": name, "M": m, "N": n, "K": k}
            row["fp8_us"] = _time_us(lambda i: gemm.fp8_linear(x, *ops.fp8[i]), ops.copies)
            row["path"] = "scaled_mm" if gemm.uses_fp8_gemm(x, ops.fp8[0][0]) else "weight_only"
            row["bf16_us"] = _time_us(lambda i: F.linear(x, ops.bf16[i]), ops.copies)
            row["fp8_gbps"] = _gbps(n, k, m, 1, row["fp8_us"])
            row["bf16_gbps"] = _gbps(n, k, m, 2, row["bf16_us"])
            row["speedup_vs_bf16"] = round(row["bf16_us"] / row["fp8_us"], 2)
            row["weight_only_us"] = _time_us(lambda i: w8a16_linear(x, *ops.fp8[i]), ops.copies)
            row["block_weight_only_us"] = _time_us(lambda i: w8a16_linear(x, *ops.block[i], None, (128, 128)),
                                                   ops.copies)
            row["block_fp8_us"] = _time_us(lambda i: gemm.fp8_linear(x, *ops.block[i], block_size=(128, 128)),
                                           ops.copies)
            row["w8a8_us"] = _time_us(lambda i: w8a8_linear(x, *ops.fp8[i]), ops.copies)
            row["block_w8a8_us"] = _time_us(lambda i: w8a8_linear(x, *ops.block[i], None, (128, 128)), ops.copies)
            row["scaled_mm_us"] = _time_us(lambda i: gemm._scaled_mm_linear(x, *ops.fp8[i], None), ops.copies)
            row["scaled_mm_torch_quant_us"] = _time_us(lambda i: old_path(x, *ops.fp8[i]), ops.copies)
            row.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       date=time.strftime("%Y-%m-%d", time.gmtime()))
            for key, value in row.items():
                if key.endswith("_us"):
                    row[key] = round(value, 2)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()


def _gemv_grid() -> list[dict[str, Any]]:
    out = []
    for bn, bk, warps in itertools.product((2, 4, 8, 16), (512, 1024, 2048, 4096), (2, 4, 8)):
        if 2048 <= bn * bk <= 32768:
            out.append({"kind": "gemv", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": 1})
    return out


def _gemm_grid(m: int) -> list[dict[str, Any]]:
    bms = [min(max(16, 1 << (m - 1).bit_length()), 64)] + ([128] if m >= 128 else [])
    out = []
    for bm, bn, bk, warps, stages in itertools.product(bms, (32, 64, 128), (64, 128, 256), (4, 8), (3, 4)):
        if warps == 8 and bm * bn < 64 * 128:
            continue
        out.append({"kind": "gemm", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
                    "num_warps": warps, "num_stages": stages})
    return out


def _jobs(ms: tuple[int, ...]) -> list[tuple[int, int, int, dict[str, Any], bool]]:
    jobs = []
    for (n, k), m in itertools.product(SHAPES.values(), ms):
        grid = (_gemv_grid() if m <= 8 else []) + (_gemm_grid(m) if m >= 2 else [])
        for cfg in grid:
            for blocked in (False, True):
                if blocked and cfg["kind"] == "gemm" and cfg["BLOCK_K"] > 128:
                    continue  # block scales cap the tl.dot kernel's BLOCK_K at 128: same kernel as 128
                jobs.append((n, k, m, cfg, blocked))
    return jobs


def _compile_worker(jobs: list[tuple[int, int, int, dict[str, Any], bool]]) -> int:
    """Runs each job once so Triton's on-disk cache holds its kernel (a spawned process per CPU)."""
    import torch
    from engine_quant_fp8.kernels import w8a16_linear

    done = 0
    cache: dict[tuple[int, int], Any] = {}
    for n, k, m, cfg, blocked in jobs:
        if (n, k) not in cache:
            cache.clear()
            w = torch.zeros(n, k, device="cuda", dtype=torch.float8_e4m3fn)
            cache[(n, k)] = (w, torch.ones(n, device="cuda"), torch.ones(-(-n // 128), -(-k // 128), device="cuda"))
        w, s, sb = cache[(n, k)]
        x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
        try:
            if blocked:
                w8a16_linear(x, w, sb, None, (128, 128), config=cfg)
            else:
                w8a16_linear(x, w, s, config=cfg)
            done += 1
        except Exception:  # out of shared memory etc.: the timing pass skips it too
            pass
    torch.cuda.synchronize()
    return done


def run_sweep(seconds_per_shape: float, workers: int, ms: tuple[int, ...]) -> None:
    import torch
    from engine_quant_fp8 import gemm
    from engine_quant_fp8.kernels import w8a16_linear

    # One job per distinct compiled kernel (Triton specializes M on divisibility by 16).
    unique: dict[str, tuple[int, int, int, dict[str, Any], bool]] = {}
    for n, k, m, cfg, blocked in _jobs(ms):
        unique.setdefault(json.dumps([k, cfg, blocked, m % 16 == 0, m == 1], sort_keys=True), (n, k, m, cfg, blocked))
    jobs = sorted(unique.values(), key=lambda j: (j[0], j[1]))
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        compiled = sum(pool.map(_compile_worker, [jobs[i::workers] for i in range(workers)]))
    print(json.dumps({"compiled": compiled, "jobs": len(jobs), "seconds": round(time.time() - t0, 1)}), flush=True)
    for name, (n, k) in SHAPES.items():
        ops = _Operands(n, k)
        _spin_up()
        for m in ms:
            deadline = time.time() + seconds_per_shape / len(ms)
            x = ops.x(m)
            row: dict[str, Any] = {"sweep": name, "M": m}
            row["bf16_us"] = round(_time_us(lambda i: torch.nn.functional.linear(x, ops.bf16[i]), ops.copies), 2)
            row["scaled_mm_us"] = round(_time_us(lambda i: gemm._scaled_mm_linear(x, *ops.fp8[i], None),
                                                 ops.copies), 2)
            for blocked in (False, True):
                operands = ops.block if blocked else ops.fp8
                extra = (None, (128, 128)) if blocked else ()
                results = []
                for cfg in (_gemv_grid() if m <= 8 else []) + (_gemm_grid(m) if m >= 2 else []):
                    if time.time() > deadline:
                        break
                    if blocked and cfg["kind"] == "gemm" and cfg["BLOCK_K"] > 128:
                        continue
                    try:
                        us = _time_us(lambda i, cfg=cfg: w8a16_linear(x, *operands[i], *extra, config=cfg),
                                      ops.copies, reps=3)
                    except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run
                        us = float("inf")
                        row.setdefault("errors", str(exc)[:80])
                    results.append((us, cfg))
                results.sort(key=lambda r: r[0])
                key = "block" if blocked else "channel"
                row[f"{key}_default_us"] = round(_time_us(lambda i: w8a16_linear(x, *operands[i], *extra),
                                                          ops.copies), 2)
                row[f"{key}_best"] = [[round(us, 2), cfg] for us, cfg in results[:3]]
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()


W8A8_MS = (32, 64, 128, 256, 1024, 4096)


def _w8a8_grid() -> list[dict[str, Any]]:
    out = []
    for bn, bk, stages in itertools.product((32, 64, 128, 256), (128, 256), (3, 4, 5)):
        if bn * bk > 128 * 256 or (bn == 256 and stages == 5):
            continue
        out.append({"BLOCK_M": 64, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
                    "num_warps": 8 if bn == 256 else 4, "num_stages": stages})
    return out


def _w8a8_compile_worker(jobs: list[tuple[int, int, dict[str, Any], bool]]) -> int:
    import torch
    from engine_quant_fp8.w8a8 import w8a8_linear

    done = 0
    for n, k, cfg, blocked in jobs:
        w = torch.zeros(n, k, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.ones(-(-n // 128), -(-k // 128), device="cuda") if blocked else torch.ones(n, device="cuda")
        try:
            w8a8_linear(torch.zeros(64, k, device="cuda", dtype=torch.bfloat16), w, s, None,
                        (128, 128) if blocked else None, config=cfg)
            done += 1
        except Exception:  # noqa: BLE001 - out of shared memory: the timing pass skips it too
            pass
    torch.cuda.synchronize()
    return done


def run_w8a8_sweep(seconds: float, workers: int, ms: tuple[int, ...]) -> None:
    import torch
    from engine_quant_fp8 import gemm
    from engine_quant_fp8.w8a8 import w8a8_linear

    jobs = [(n, k, cfg, blocked) for n, k in {(4096, 4096), (4096, 14336)} for cfg in _w8a8_grid()
            for blocked in (False, True) if not (blocked and cfg["BLOCK_K"] > 128)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        compiled = sum(pool.map(_w8a8_compile_worker, [jobs[i::workers] for i in range(workers)]))
    print(json.dumps({"w8a8_compiled": compiled, "jobs": len(jobs), "seconds": round(time.time() - t0, 1)}), flush=True)
    for name, (n, k) in SHAPES.items():
        ops = _Operands(n, k)
        _spin_up()
        for m in ms:
            deadline = time.time() + seconds / len(SHAPES) / len(ms)
            x = ops.x(m)
            row: dict[str, Any] = {"w8a8_sweep": name, "M": m}
            row["bf16_us"] = round(_time_us(lambda i: torch.nn.functional.linear(x, ops.bf16[i]), ops.copies), 2)
            row["scaled_mm_us"] = round(_time_us(lambda i: gemm._scaled_mm_linear(x, *ops.fp8[i], None),
                                                 ops.copies), 2)
            for blocked in (False, True):
                operands, extra = (ops.block, (None, (128, 128))) if blocked else (ops.fp8, ())
                results = []
                for cfg in _w8a8_grid():
                    if time.time() > deadline:
                        break
                    if blocked and cfg["BLOCK_K"] > 128:
                        continue
                    try:
                        us = _time_us(lambda i, cfg=cfg: w8a8_linear(x, *operands[i], *extra, config=cfg),
                                      ops.copies, reps=3)
                    except Exception:  # noqa: BLE001
                        continue
                    results.append((round(us, 2), cfg))
                results.sort(key=lambda r: r[0])
                key = "block" if blocked else "channel"
                row[f"{key}_default_us"] = round(_time_us(lambda i: w8a8_linear(x, *operands[i], *extra),
                                                          ops.copies), 2)
                row[f"{key}_best"] = [[us, {k2: v for k2, v in c.items() if k2 != "GROUP_M"}] for us, c in results[:3]]
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()


#: Larger Triton fp8 x fp8 tiles tried by --large (128-row tiles: two warpgroups of wgmma).
LARGE_CONFIGS = (
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
)


def run_large(ms: tuple[int, ...], peak_fp8: float, peak_bf16: float, triton_configs: bool) -> None:
    import torch
    from engine_quant_fp8.kernels import quantize_per_token_triton
    from engine_quant_fp8.w8a8 import w8a8_gemm

    for name, (n, k) in SHAPES.items():
        ops = _Operands(n, k)
        _spin_up()
        for m in ms:
            x = ops.x(m)
            qx, sx = quantize_per_token_triton(x)
            flop = 2.0 * m * n * k
            row: dict[str, Any] = {"large": name, "M": m, "N": n, "K": k}

            def put(key: str, us: float, peak: float) -> None:
                tflops = flop / (us * 1e-6) / 1e12
                row[key] = [round(us, 1), round(tflops), round(tflops / peak, 3)]  # us, TFLOPS, of peak

            put("bf16", _time_us(lambda i: torch.nn.functional.linear(x, ops.bf16[i]), ops.copies), peak_bf16)
            put("scaled_mm", _time_us(lambda i: torch._scaled_mm(qx, ops.fp8[i][0].t(), scale_a=sx,
                                                                 scale_b=ops.fp8[i][1][None, :],
                                                                 out_dtype=torch.bfloat16), ops.copies), peak_fp8)
            try:
                put("scaled_mm_fast", _time_us(lambda i: torch._scaled_mm(
                    qx, ops.fp8[i][0].t(), scale_a=sx, scale_b=ops.fp8[i][1][None, :], out_dtype=torch.bfloat16,
                    use_fast_accum=True), ops.copies), peak_fp8)
                # Both products' relative L2 error against float32 maths on the same codes (row-wise
                # scales take a bf16 output only).
                w, ws = ops.fp8[0]
                ref = (qx.float() * sx) @ (w.float() * ws[:, None]).t()
                for key, fast in (("slow_rel_l2", False), ("fast_rel_l2", True)):
                    got = torch._scaled_mm(qx, w.t(), scale_a=sx, scale_b=ws[None, :], out_dtype=torch.bfloat16,
                                           use_fast_accum=fast)
                    row[key] = float(f"{((got.float() - ref).norm() / ref.norm()).item():.2e}")
                del ref, got
            except RuntimeError as exc:  # a torch build or scaling mode without it
                row["scaled_mm_fast"] = str(exc)[:80]
            row["quant_us"] = round(_time_us(lambda i: quantize_per_token_triton(x), 2), 1)
            put("w8a8_default", _time_us(lambda i: w8a8_gemm(qx, sx, *ops.fp8[i], None, torch.bfloat16),
                                         ops.copies), peak_fp8)
            for j, cfg in enumerate(LARGE_CONFIGS if triton_configs else ()):
                try:
                    put(f"w8a8_cfg{j}", _time_us(lambda i, c=cfg: w8a8_gemm(qx, sx, *ops.fp8[i], None,
                                                                            torch.bfloat16, config=c), ops.copies),
                        peak_fp8)
                except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot run (shared memory)
                    row[f"w8a8_cfg{j}"] = str(exc)[:60]
            row["device"] = torch.cuda.get_device_name()
            print(json.dumps(row), flush=True)
            del x, qx, sx
        del ops
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="token counts, comma separated")
    parser.add_argument("--sweep", type=float, default=0.0, help="tune configs: seconds of timing per shape")
    parser.add_argument("--sweep-w8a8", type=float, default=0.0,
                        help="tune the fp8 x fp8 Triton GEMM: seconds of timing in all")
    parser.add_argument("--sweep-ms", default=None, help="token counts of a sweep, comma separated")
    parser.add_argument("--workers", type=int, default=12, help="processes compiling kernels before a sweep")
    parser.add_argument("--large", default=None, help="token counts for the fp8 x fp8 GEMM table, comma separated")
    parser.add_argument("--no-triton-configs", action="store_true", help="--large: only the Triton default config")
    parser.add_argument("--peak-fp8", type=float, default=1979.0, help="dense fp8 TFLOPS (H200/H100 SXM: 1979)")
    parser.add_argument("--peak-bf16", type=float, default=989.0, help="dense bf16 TFLOPS (H200/H100 SXM: 989)")
    args = parser.parse_args()
    if args.large:
        run_large(tuple(int(m) for m in args.large.split(",")), args.peak_fp8, args.peak_bf16,
                  not args.no_triton_configs)
        return
    sweep_ms = tuple(int(m) for m in args.sweep_ms.split(",")) if args.sweep_ms else None
    if args.sweep_w8a8:
        run_w8a8_sweep(args.sweep_w8a8, args.workers, sweep_ms or W8A8_MS)
    elif args.sweep:
        run_sweep(args.sweep, args.workers, sweep_ms or SWEEP_MS)
    else:
        run_default(tuple(int(m) for m in args.ms.split(",")))


if __name__ == "__main__":
    main()
