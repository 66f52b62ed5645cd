"""The small-batch expert kernels against the grouped ones, on cold weights (GPU only).

For each shape and token count, one MoE layer's experts as a decode step runs them past the router's
gate linear, inside a CUDA graph that cycles through distinct random routings (so each call reads
experts the previous ones did not leave in L2; at batch 1 one call's experts are 38 MB for the
Qwen3-30B-A3B shape, under the H100's 50 MB L2):

- ``small``: the router, then ``fused_moe_small_batch`` (gate/up, down with the top-k sum);
- ``grouped``: routing and alignment as ``FusedMoE`` runs them at that size (one launch up to
  ``ROUTE_ALIGN_PAYS_MAX_SLOTS``, else router + alignment), the two grouped GEMMs and the top-k sum.

For a shape with shared experts (DeepSeek-V2-Lite: two of the routed experts' size, one SwiGLU MLP),
``--tokens 1`` also times them: ``shared_fused`` (``fused_moe_small_batch(..., shared=...)``: the
router, then the two launches streaming routed and shared weights) against ``shared_separate`` (the
router, the two routed launches, then the shared MLP as the engine's CUDA platform runs it at batch
1: its skinny GEMV, SiLU-and-mul, the GEMV, the add).

GB/s counts the bytes of the experts a call touches (weights only): comparable with the card's copy
bandwidth. ``--sweep`` times the small kernels' tiles at one token instead and prints the best (with
the shape's shared experts in the launches; one copy of their weights per routing, so they are cold
too). ``--launch both`` times the default gate/up tile followed by each down tile reading its output,
and prints the gate/up tile's time alone first: the difference is what the down launch costs in a
decode step's sequence. ``--pdl`` launches with programmatic dependent launch, as the engine does
on sm_90+; ``--ahead 0 1`` times each down tile without and with its weights requested a K step
ahead.

usage: python benchmarks/bench_moe_small.py [--shape qwen3-30b-a3b] [--tokens 1 2 4 8] [--sweep]
       [--launch gate_up down both] [--pdl] [--ahead 0 1] [--warps 4 8] [--stages 1 2] [--block-n 1 2] [--block-k 256 512]
       [--result-file out/results.jsonl]

``--launch``, ``--ahead``, ``--warps``, ``--stages``, ``--block-n`` and ``--block-k`` narrow or widen the sweep
(each tile is a Triton compile of about a second).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton
from engine_platform_cuda.graph_timing import graph_median_us

from engine.bench.results import append_rows

#: experts, hidden, intermediate, top_k
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2),
          "deepseek-v2-lite": (64, 2048, 1408, 6)}
#: shared experts, in routed experts' intermediate widths
SHARED = {"deepseek-v2-lite": 2}
ROUTINGS = 8


def _setup(shape: str, tokens: int) -> tuple:
    experts, hidden, inter, top_k = SHAPES[shape]
    dev, dtype = "cuda", torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dtype) * 0.02
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    logits = [torch.randn(tokens, experts, generator=gen).to(dev) for _ in range(ROUTINGS)]
    return experts, hidden, inter, top_k, w13, w2, x, logits


def _touched_bytes(logits: list[torch.Tensor], top_k: int, hidden: int, inter: int) -> float:
    touched = sum(len(torch.unique(torch.topk(lg, top_k, dim=-1).indices)) for lg in logits) / len(logits)
    return touched * 3 * hidden * inter * 2


def compare(shape: str, tokens: int) -> dict[str, object]:
    from engine.layers.moe.fused_moe import fused_moe, pick_blocks
    from engine.layers.moe.route_align import route_and_align
    from engine.layers.moe.router import select_experts
    from engine.layers.moe.small_batch import fused_moe_small_batch, small_batch_applies

    experts, hidden, inter, top_k, w13, w2, x, logits = _setup(shape, tokens)
    block_m = pick_blocks(tokens * top_k, experts)["BLOCK_M"]

    def small(lg: torch.Tensor) -> torch.Tensor:
        w, ids = select_experts(lg, top_k, True)
        return fused_moe_small_batch(x, w13, w2, w, ids)

    def grouped(lg: torch.Tensor) -> torch.Tensor:
        w, ids, blocks = route_and_align(lg, top_k, True, block_m)
        return fused_moe(x, w13, w2, w, ids, blocks=blocks)

    nbytes = _touched_bytes(logits, top_k, hidden, inter)
    row: dict[str, object] = {"bench": "moe_small_vs_grouped", "shape": shape, "tokens": tokens,
                              "default": "small" if small_batch_applies(tokens, top_k, experts) else "grouped"}
    for name, fn in (("small", small), ("grouped", grouped)):
        us = graph_median_us([lambda lg=lg, f=fn: f(lg) for lg in logits])
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_gbs"] = round(nbytes / us / 1e3, 1)
    torch.testing.assert_close(small(logits[0]), grouped(logits[0]), atol=2e-2, rtol=2e-2)
    if SHARED.get(shape) and tokens == 1:
        row.update(_shared(x, w13, w2, logits, top_k, SHARED[shape] * inter, nbytes))
    row.update(gpu=torch.cuda.get_device_name(), time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return row


def _shared(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, logits: list[torch.Tensor], top_k: int,
            width: int, routed_bytes: float) -> dict[str, object]:
    from engine_platform_cuda.gemv import skinny_linear
    from engine_platform_cuda.kernels import silu_and_mul

    from engine.layers.moe.router import select_experts
    from engine.layers.moe.small_batch import fused_moe_small_batch

    hidden = x.shape[1]
    # One copy of the shared MLP per routing: as cold as the routed experts (one copy stays in L2).
    gate_ups = [torch.randn(2 * width, hidden, device=x.device, dtype=x.dtype) * 0.02 for _ in logits]
    downs = [torch.randn(hidden, width, device=x.device, dtype=x.dtype) * 0.02 for _ in logits]

    def fused(i: int) -> torch.Tensor:
        w, ids = select_experts(logits[i], top_k, True)
        return fused_moe_small_batch(x, w13, w2, w, ids, shared=(gate_ups[i], downs[i]))

    def separate(i: int) -> torch.Tensor:
        w, ids = select_experts(logits[i], top_k, True)
        shared = skinny_linear(silu_and_mul(skinny_linear(x, gate_ups[i])), downs[i])
        return fused_moe_small_batch(x, w13, w2, w, ids) + shared

    nbytes = routed_bytes + 3 * hidden * width * 2
    row: dict[str, object] = {}
    for name, fn in (("shared_fused", fused), ("shared_separate", separate)):
        us = graph_median_us([lambda i=i, f=fn: f(i) for i in range(len(logits))])
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_gbs"] = round(nbytes / us / 1e3, 1)
    torch.testing.assert_close(fused(0), separate(0), atol=2e-2, rtol=2e-2)
    return row


def sweep(shape: str, launches: tuple[str, ...] = ("gate_up", "down"), warp_counts: tuple[int, ...] = (4, 8),
          stage_counts: tuple[int, ...] = (1,), block_n: tuple[int, ...] | None = None,
          block_k: tuple[int, ...] | None = None, pdl: bool = False,
          ahead: tuple[int, ...] = (0,)) -> list[dict[str, object]]:
    from engine.layers.moe.router import select_experts
    from engine.layers.moe.small_batch import launch_down, launch_gate_up, small_batch_tiles

    experts, hidden, inter, top_k, w13, w2, x, logits = _setup(shape, 1)
    routes = [select_experts(lg, top_k, True) for lg in logits]
    chunks = SHARED.get(shape, 0)  # the shared experts ride in the same launches
    # One copy of the shared experts' weights per routing, so they are as cold as the routed ones
    # (one copy would stay in L2 from call to call: a quarter of DeepSeek-V2-Lite's bytes).
    gate_ups = [torch.randn(2 * chunks * inter, hidden, device="cuda", dtype=x.dtype) * 0.02 if chunks else None
                for _ in routes]
    downs = [torch.randn(hidden, chunks * inter, device="cuda", dtype=x.dtype) * 0.02 if chunks else None
             for _ in routes]
    act = torch.randn(top_k + chunks, inter, device="cuda", dtype=x.dtype)
    out_act = torch.empty_like(act)
    out = torch.empty(1, hidden, device="cuda", dtype=x.dtype)
    slots = top_k + chunks
    default = small_batch_tiles(slots, hidden, inter)

    def up(i: int, bn: int, bk: int, warps: int, stages: int) -> None:
        launch_gate_up(x, w13, None, routes[i][1], out_act, bn, bk, warps, pdl=pdl, shared_w13=gate_ups[i],
                       chunks=chunks, num_stages=stages)

    def down(i: int, bn: int, bk: int, warps: int, stages: int, ah: int = 0, src: torch.Tensor = act) -> None:
        launch_down(src, w2, None, routes[i][1], routes[i][0], out, bn, bk, warps, pdl=pdl, shared_w2=downs[i],
                    chunks=chunks, num_stages=stages, ahead=bool(ah))

    def both(i: int, bn: int, bk: int, warps: int, stages: int, ah: int = 0) -> None:
        # The default gate/up tile, then the down tile reading its output, as a decode step runs them.
        up(i, default["UP_BLOCK_N"], default["UP_BLOCK_K"], default["UP_WARPS"], 1)
        down(i, bn, bk, warps, stages, ah, src=out_act)

    rows = []
    grids = {"gate_up": ((2, 4, 8, 16, 32), (64, 128, 256, 512)), "down": ((1, 2, 4, 8, 16), (64, 128, 256, 512))}
    grids["both"] = grids["down"]
    for launch in launches:
        grid_n, grid_k = block_n or grids[launch][0], block_k or grids[launch][1]
        nbytes = slots * {"gate_up": 2, "down": 1, "both": 3}[launch] * hidden * inter * 2
        fn = {"gate_up": up, "down": down, "both": both}[launch]
        results = []
        if launch == "both":
            alone = graph_median_us([lambda i=i: up(i, default["UP_BLOCK_N"], default["UP_BLOCK_K"],
                                                    default["UP_WARPS"], 1) for i in range(len(routes))])
            print(f"# gate_up{' (pdl)' if pdl else ''} default tile alone: {alone:.2f} us", flush=True)
        aheads = (0,) if launch == "gate_up" else ahead
        for bn, bk, warps, stages, ah in itertools.product(grid_n, grid_k, warp_counts, stage_counts, aheads):
            if bn * bk * (2 if launch == "gate_up" else triton.next_power_of_2(slots)) > 16384:
                continue
            if launch == "gate_up":
                calls = [lambda i=i, a=bn, b=bk, c=warps, d=stages: up(i, a, b, c, d) for i in range(len(routes))]
            else:
                calls = [lambda i=i, a=bn, b=bk, c=warps, d=stages, e=ah, f=fn: f(i, a, b, c, d, e)
                         for i in range(len(routes))]
            us = graph_median_us(calls)
            results.append({"block_n": bn, "block_k": bk, "warps": warps, "stages": stages, "ahead": ah,
                            "us": round(us, 2), "gbs": round(nbytes / us / 1e3, 1)})
            # Each tile as it is timed: a run cut by a time limit still tells.
            print(f"# {launch}{' (pdl)' if pdl else ''} {bn} x {bk}, {warps} warps, {stages} stages"
                  f"{', weights a step ahead' if ah else ''}: {us:.2f} us ({nbytes / us / 1e3:.0f} GB/s)", flush=True)
        results.sort(key=lambda r: r["us"])
        prefix = "UP" if launch == "gate_up" else "DOWN"
        mine = next((r for r in results if r["block_n"] == default[f"{prefix}_BLOCK_N"]
                     and r["block_k"] == default[f"{prefix}_BLOCK_K"] and r["warps"] == default[f"{prefix}_WARPS"]
                     and r["stages"] == default.get(f"{prefix}_STAGES", 1)
                     and r["ahead"] == default.get(f"{prefix}_AHEAD", 0)), None)
        row = {"bench": "moe_small_sweep", "shape": shape, "launch": launch, "shared_chunks": chunks, "pdl": pdl,
               "default": mine, "best": results[:5],
               "gpu": torch.cuda.get_device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--launch", nargs="+", default=["gate_up", "down"], choices=["gate_up", "down", "both"],
                    help="--sweep: which launches' tiles to time (both: the default gate/up tile, then each down "
                         "tile reading its output)")
    ap.add_argument("--pdl", action="store_true", help="--sweep: launch with programmatic dependent launch")
    ap.add_argument("--ahead", nargs="+", type=int, default=[0], choices=[0, 1],
                    help="--sweep: down weights requested a K step ahead (1) or not (0)")
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8], help="--sweep: warp counts to time")
    ap.add_argument("--stages", nargs="+", type=int, default=[1], help="--sweep: software-pipeline stages to time")
    ap.add_argument("--block-n", nargs="+", type=int, default=None, help="--sweep: BLOCK_N values (default: a grid)")
    ap.add_argument("--block-k", nargs="+", type=int, default=None, help="--sweep: BLOCK_K values (default: a grid)")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    if a.sweep:
        rows = sweep(a.shape, tuple(a.launch), tuple(a.warps), tuple(a.stages), a.block_n and tuple(a.block_n),
                     a.block_k and tuple(a.block_k), a.pdl, tuple(a.ahead))
    else:
        rows = [compare(a.shape, t) for t in a.tokens]
    for row in rows:
        print(json.dumps(row), flush=True)
        append_rows(a.result_file, row)


if __name__ == "__main__":
    main()
