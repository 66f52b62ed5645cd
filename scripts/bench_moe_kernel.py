"""Times the fused MoE Triton kernel against the per-expert loop and a dense MLP (GPU only).

For each model shape and token count: the fused kernel (``engine.layers.moe.fused_moe``), the
per-expert torch loop (``fused_moe_reference``: one gather + two GEMMs per expert that got
tokens), and a dense SwiGLU MLP with the same *active* parameters (intermediate size
``top_k * I``), all bf16; plus the fused kernel on fp8 experts. Routing is random (softmax top-k
of Gaussian logits), so a batch of ``T`` tokens touches about ``E * (1 - (1 - k/E)^T)`` experts.
"GB/s" is the bytes of the experts the batch touches (weights only) over the time: at batch 1
the kernel should approach the card's copy bandwidth.

Then, per token count, the launches around the GEMMs: the one-launch router and slot alignment
against their torch versions (``select_experts_reference``, ``align_slots_reference``; the
alignment kernel is used up to ``ALIGN_KERNEL_MAX_SLOTS`` slots, and this row is what that cap
should be tuned on), and the SiLU-and-mul launch. These are eager timings of one call each; in a
CUDA graph the torch versions lose the host overhead but keep their ~30 launches.

usage: python scripts/bench_moe_kernel.py [--shapes qwen3-30b-a3b mixtral-8x7b] [--tokens 1 8 64 256 1024]
       [--result-file out/results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

# The activation the model uses on CUDA: the cuda platform's fused kernel (Platform.layer_kernels).
from engine_platform_cuda.kernels import silu_and_mul

# name -> (experts, hidden, expert intermediate, top_k), from docs/bench_configs/*/config.json
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2)}


def _time_ms(fn, iters: int = 50) -> float:  # type: ignore[no-untyped-def]
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=iters))


def bench_shape(name: str, tokens_list: list[int], fp8: bool) -> list[dict[str, object]]:
    from engine.layers.moe.fused_moe import fused_moe
    from engine.layers.moe.reference import fused_moe_reference
    from engine.layers.moe.router import select_experts

    experts, hidden, inter, top_k = SHAPES[name]
    dev, dtype = "cuda", torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dtype) * 0.02
    dense_gu = torch.randn(2 * inter * top_k, hidden, device=dev, dtype=dtype) * 0.02
    dense_d = torch.randn(hidden, inter * top_k, device=dev, dtype=dtype) * 0.02
    q13 = q2 = s13 = s2 = None
    if fp8:
        def quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            s = w.float().abs().amax(-1).clamp(min=1e-12) / 448.0
            return (w.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s
        q13, s13 = quant(w13)
        q2, s2 = quant(w2)
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        w, ids = select_experts(torch.randn(tokens, experts, device=dev), top_k, renormalize=True)
        touched = int(torch.unique(ids).numel())
        expert_bytes = touched * 3 * hidden * inter * 2

        def dense() -> torch.Tensor:
            gu = F.linear(x, dense_gu)
            return F.linear(F.silu(gu[:, :inter * top_k]) * gu[:, inter * top_k:], dense_d)

        t_fused = _time_ms(lambda: fused_moe(x, w13, w2, w, ids, act_fn=silu_and_mul))
        t_loop = _time_ms(lambda: fused_moe_reference(x, w13, w2, w, ids), iters=20)
        t_dense = _time_ms(dense)
        row: dict[str, object] = {
            "bench": "moe_kernel", "shape": name, "tokens": tokens, "experts_touched": touched,
            "fused_ms": round(t_fused, 4), "per_expert_loop_ms": round(t_loop, 4), "dense_same_active_ms": round(t_dense, 4),
            "fused_GBps": round(expert_bytes / t_fused / 1e6, 1), "speedup_vs_loop": round(t_loop / t_fused, 2),
            "gpu": torch.cuda.get_device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if fp8:
            t_fp8 = _time_ms(lambda: fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, act_fn=silu_and_mul))
            row["fused_fp8_ms"] = round(t_fp8, 4)
            row["fused_fp8_GBps"] = round(expert_bytes / 2 / t_fp8 / 1e6, 1)
        rows.append(row)
        print(f"{name:14s} T={tokens:5d} experts={touched:3d}  fused {t_fused:8.3f} ms ({row['fused_GBps']} GB/s)"
              f"  loop {t_loop:8.3f} ms (x{row['speedup_vs_loop']})  dense-same-active {t_dense:7.3f} ms"
              + (f"  fused-fp8 {row['fused_fp8_ms']} ms" if fp8 else ""), flush=True)
    return rows


def bench_routing(name: str, tokens_list: list[int]) -> list[dict[str, object]]:
    from engine.layers.moe.align import align_slots_reference, kernel_can_align
    from engine.layers.moe.align_kernel import align_slots_triton
    from engine.layers.moe.fused_moe import pick_blocks
    from engine.layers.moe.router import select_experts_reference
    from engine.layers.moe.router_kernel import select_experts_triton

    experts, _, inter, top_k = SHAPES[name]
    rows = []
    for tokens in tokens_list:
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
        _, ids = select_experts_triton(logits, top_k, True)
        block_m = pick_blocks(tokens * top_k, experts)["BLOCK_M"]
        gate_up = torch.randn(tokens * top_k, 2 * inter, device="cuda", dtype=torch.bfloat16)
        row: dict[str, object] = {
            "bench": "moe_routing", "shape": name, "tokens": tokens, "block_m": block_m,
            "router_kernel_us": round(_time_ms(lambda: select_experts_triton(logits, top_k, True)) * 1e3, 2),
            "router_torch_us": round(_time_ms(lambda: select_experts_reference(logits, top_k, True)) * 1e3, 2),
            "align_torch_us": round(_time_ms(lambda: align_slots_reference(ids, experts, block_m)) * 1e3, 2),
            "silu_and_mul_us": round(_time_ms(lambda: silu_and_mul(gate_up)) * 1e3, 2),
            "gpu": torch.cuda.get_device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if kernel_can_align(tokens * top_k, block_m):
            row["align_kernel_us"] = round(_time_ms(lambda: align_slots_triton(ids, experts, block_m)) * 1e3, 2)
        rows.append(row)
        print(f"{name:14s} T={tokens:5d}  router {row['router_kernel_us']} us (torch {row['router_torch_us']})"
              f"  align {row.get('align_kernel_us', '-')} us (torch {row['align_torch_us']})"
              f"  silu_and_mul {row['silu_and_mul_us']} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 256, 1024])
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8-expert timing")
    ap.add_argument("--result-file", default=None, help="append one JSON line per measurement")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_kernel.py: needs a CUDA GPU")
    for name in args.shapes:
        rows = bench_shape(name, args.tokens, fp8=not args.no_fp8) + bench_routing(name, args.tokens)
        if args.result_file:
            with open(args.result_file, "a", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
