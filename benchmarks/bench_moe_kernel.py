"""Times the fused MoE Triton kernel against the per-expert loop and a dense MLP (GPU only).

For each model shape and token count: the fused kernel (``engine.layers.moe.fused_moe``), the
per-expert torch loop (``fused_moe_reference``: one gather + two GEMMs per expert that got
tokens), and a dense SwiGLU MLP with the same *active* parameters (intermediate size
``top_k * I``), all bf16; plus the fused kernel on fp8 experts. Routing is random (softmax top-k
of Gaussian logits), so a batch of ``T`` tokens touches about ``E * (1 - (1 - k/E)^T)`` experts.
"GB/s" is the bytes of the experts the batch touches (weights only) over the time: at batch 1
the kernel should approach the card's copy bandwidth.

Then, per token count, the launches around the GEMMs, each timed as a CUDA graph replays it
(what a decode step with graphs pays, launch gaps included, host overhead not): routing and
alignment in one launch (``route_and_align_triton``, timed wherever it fits; ``FusedMoE`` runs it up
to ``ROUTE_ALIGN_PAYS_MAX_SLOTS``, the cap chosen from these rows) against the router and alignment launches it replaces and their torch
versions (``select_experts_reference``, ``align_slots_reference``; the alignment kernel is used
up to ``ALIGN_KERNEL_MAX_SLOTS`` slots, and this row is what that cap should be tuned on); the
top-k sum kernel (``sum_top_k``) against ``y.view(T, k, H).sum(1)``; the SiLU-and-mul launch the
gate/up epilogue removes; and the whole MoE step past the router's gate linear, new (one routing
launch, SiLU-and-mul in the gate/up epilogue) against separate routing launches and an activation
launch (``fused_moe(act_fn=silu_and_mul)``). The ``fused_ms`` rows above are eager (host overhead
included) and use the epilogue; ``fused_act_fn_ms`` is the same call with the activation launch.

usage: python benchmarks/bench_moe_kernel.py [--shapes qwen3-30b-a3b mixtral-8x7b] [--tokens 1 8 64 256 1024]
       [--pieces-only] [--result-file out/results.jsonl]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# The cuda platform's fused activation kernel: what the gate/up epilogue replaces, timed against it.
from engine_platform_cuda.kernels import silu_and_mul

from engine.bench.results import append_rows

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

        t_fused = _time_ms(lambda: fused_moe(x, w13, w2, w, ids))
        t_act_fn = _time_ms(lambda: fused_moe(x, w13, w2, w, ids, act_fn=silu_and_mul))
        t_loop = _time_ms(lambda: fused_moe_reference(x, w13, w2, w, ids), iters=20)
        t_dense = _time_ms(dense)
        row: dict[str, object] = {
            "bench": "moe_kernel", "shape": name, "tokens": tokens, "experts_touched": touched,
            "fused_ms": round(t_fused, 4), "fused_act_fn_ms": round(t_act_fn, 4), "per_expert_loop_ms": round(t_loop, 4), "dense_same_active_ms": round(t_dense, 4),
            "fused_GBps": round(expert_bytes / t_fused / 1e6, 1), "speedup_vs_loop": round(t_loop / t_fused, 2),
            "gpu": torch.cuda.get_device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if fp8:
            t_fp8 = _time_ms(lambda: fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2))
            row["fused_fp8_ms"] = round(t_fp8, 4)
            row["fused_fp8_GBps"] = round(expert_bytes / 2 / t_fp8 / 1e6, 1)
        rows.append(row)
        print(f"{name:14s} T={tokens:5d} experts={touched:3d}  fused {t_fused:8.3f} ms ({row['fused_GBps']} GB/s;"
              f" with the activation launch {t_act_fn:8.3f} ms)"
              f"  loop {t_loop:8.3f} ms (x{row['speedup_vs_loop']})  dense-same-active {t_dense:7.3f} ms"
              + (f"  fused-fp8 {row['fused_fp8_ms']} ms" if fp8 else ""), flush=True)
    return rows


def _graph_us(fn, calls: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls: what a decode
    step (graphs on) pays for it, launch gaps included, host overhead not."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _time_ms(graph.replay) * 1e3 / calls


def bench_pieces(name: str, tokens_list: list[int]) -> list[dict[str, object]]:
    """The launches around the GEMMs, each timed in a CUDA graph, new against what they replace."""
    experts, hidden, inter, _ = SHAPES[name]
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    return [_pieces_row(name, tokens, w13, w2) for tokens in tokens_list]


def _pieces_row(name: str, tokens: int, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, object]:
    from engine.layers.moe.align import align_slots_reference, kernel_can_align
    from engine.layers.moe.align_kernel import align_slots_triton
    from engine.layers.moe.fused_moe import fused_moe, pick_blocks, sum_top_k
    from engine.layers.moe.route_align import route_align_fits
    from engine.layers.moe.route_align_kernel import route_and_align_triton
    from engine.layers.moe.router import select_experts_reference
    from engine.layers.moe.router_kernel import select_experts_triton

    experts, hidden, inter, top_k = SHAPES[name]
    dtype = torch.bfloat16
    slots = tokens * top_k
    logits = torch.randn(tokens, experts, device="cuda", dtype=dtype)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    _, ids = select_experts_triton(logits, top_k, True)
    block_m = pick_blocks(slots, experts)["BLOCK_M"]
    gate_up = torch.randn(slots, 2 * inter, device="cuda", dtype=dtype)
    down = torch.randn(slots, hidden, device="cuda", dtype=dtype)

    def router_then_align() -> None:
        _, i = select_experts_triton(logits, top_k, True)
        align_slots_triton(i, experts, block_m)

    def step_one_launch_routing() -> torch.Tensor:  # what FusedMoE runs at decode sizes
        w, i, blocks = route_and_align_triton(logits, top_k, True, block_m)
        return fused_moe(x, w13, w2, w, i, blocks=blocks)

    def step_separate() -> torch.Tensor:  # router and align launches, activation launch
        w, i = select_experts_triton(logits, top_k, True)
        return fused_moe(x, w13, w2, w, i, act_fn=silu_and_mul)

    row: dict[str, object] = {
        "bench": "moe_pieces", "shape": name, "tokens": tokens, "block_m": block_m, "timing": "cuda_graph",
        "router_kernel_us": round(_graph_us(lambda: select_experts_triton(logits, top_k, True)), 2),
        "router_torch_us": round(_graph_us(lambda: select_experts_reference(logits, top_k, True)), 2),
        "align_torch_us": round(_graph_us(lambda: align_slots_reference(ids, experts, block_m)), 2),
        "sum_kernel_us": round(_graph_us(lambda: sum_top_k(down, tokens, top_k)), 2),
        "sum_torch_us": round(_graph_us(lambda: down.view(tokens, top_k, hidden).sum(dim=1)), 2),
        "silu_and_mul_us": round(_graph_us(lambda: silu_and_mul(gate_up)), 2),
        "step_separate_us": round(_graph_us(step_separate), 2),
        "gpu": torch.cuda.get_device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if kernel_can_align(slots, block_m):
        row["align_kernel_us"] = round(_graph_us(lambda: align_slots_triton(ids, experts, block_m)), 2)
        row["router_then_align_us"] = round(_graph_us(router_then_align), 2)
    if route_align_fits(tokens, experts, top_k, block_m):
        row["route_align_us"] = round(_graph_us(lambda: route_and_align_triton(logits, top_k, True, block_m)), 2)
        row["step_one_launch_routing_us"] = round(_graph_us(step_one_launch_routing), 2)
    print(f"{name:14s} T={tokens:5d}  router+align: one launch {row.get('route_align_us', '-')} us, "
          f"two {row.get('router_then_align_us', '-')} us (router {row['router_kernel_us']}, align "
          f"{row.get('align_kernel_us', '-')}; torch {row['router_torch_us']} + {row['align_torch_us']})"
          f"  sum {row['sum_kernel_us']} us (torch {row['sum_torch_us']})  silu_and_mul {row['silu_and_mul_us']} us"
          f"  | MoE step (experts + routing): {row.get('step_one_launch_routing_us', '-')} us "
          f"(separate routing launches + activation launch: {row['step_separate_us']} us)", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 256, 1024])
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8-expert timing")
    ap.add_argument("--pieces-only", action="store_true",
                    help="only the launches around the GEMMs (routing, alignment, top-k sum): no expert GEMM timing")
    ap.add_argument("--result-file", default=None, help="append one JSON line per measurement")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_kernel.py: needs a CUDA GPU")
    for name in args.shapes:
        rows = [] if args.pieces_only else bench_shape(name, args.tokens, fp8=not args.no_fp8)
        rows += bench_pieces(name, args.tokens)
        append_rows(args.result_file, *rows)


if __name__ == "__main__":
    main()
