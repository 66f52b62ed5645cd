"""Sweeps the fused MoE kernel's tile sizes per launch on cold weights (GPU only).

``pick_blocks`` (engine.layers.moe.fused_moe) is a hand-written table, not autotuned. This script
times each of the two grouped GEMM launches (gate/up with the SiLU-and-mul epilogue, and down)
for a grid of ``BLOCK_N``, ``BLOCK_K``, ``num_warps`` and ``num_stages`` at each token count,
inside a CUDA graph that cycles through distinct random routings so that each call reads experts
the previous calls did not leave in L2 (at batch 1 one call's experts are 38 MB for the
Qwen3-30B-A3B shape, under the H100's 50 MB L2: timing one routing over and over measures L2,
not HBM). GB/s counts the bytes of the experts each call touches, so at batch 1 it is directly
comparable with the card's copy bandwidth.

``--prefill`` sweeps ``BLOCK_M`` as well, over a grid of tensor-core tiles for prefill-sized
batches (hundreds of slots per expert, where the launches are bound by compute, not bytes), with
fewer routings cycled (a prefill's activations are far larger than L2 anyway).

``--tiers`` times only ``pick_blocks``' own tiers (and the middle tier it replaced, ``OLD_MIDDLE_TIER``)
at each token count: whether the tier it picks for a shape is the best of them there (the table was
swept at the Qwen3-30B-A3B shape; ``--shape mixtral-8x7b`` checks it elsewhere).

usage: python benchmarks/sweep_moe_tiles.py [--shape qwen3-30b-a3b] [--tokens 1 8 64] [--top 5]
       [--prefill | --tiers] [--result-file out/results.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from engine_platform_cuda.graph_timing import graph_median_us

from engine.bench.results import append_rows

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2)}


#: ``--prefill`` candidates: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). For gate/up
#: ``BLOCK_N`` is each of its two accumulators' width (``fused_moe`` halves ``pick_blocks``' value).
PREFILL_TILES = [(64, 64, 64, 4, 3), (64, 64, 64, 8, 3), (64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (64, 128, 64, 8, 3),
                 (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3),
                 (128, 128, 64, 8, 4), (128, 128, 32, 8, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 2)]
DECODE_TILES = list(itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (2, 3, 4)))
#: ``pick_blocks``' tier for 17-64 slots an expert before the 64 x 128 tier existed (``--tiers`` times it too).
OLD_MIDDLE_TIER = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


#: The keys of a tile config as ``_grouped_gemm`` reads them (``pick_blocks``' ``up_num_stages`` is
#: folded into the gate/up launch's ``num_stages`` by ``_gate_up_config``).
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def tiles(cfg: dict[str, int]) -> dict[str, int]:
    return {key: cfg[key] for key in TILE_KEYS}


def candidates(prefill: bool, base: dict[str, int], current: list[dict[str, int]],
               own_tiers: list[dict[str, int]] | None = None) -> list[dict[str, int]]:
    """The configs swept: ``base`` (``pick_blocks``' tiles) with the decode grid's N, K, warps and
    stages, or the prefill tiles plus what ``fused_moe`` launches now (``current``), so it is timed;
    with ``own_tiers`` (``--tiers``: ``tier_configs``) just those, which hold what it launches."""
    if own_tiers is not None:
        return own_tiers
    if prefill:
        grid = [{**base, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
                for bm, bn, bk, w, st in PREFILL_TILES]
        return grid + [c for c in current if c not in grid]
    return [{**base, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
            for bn, bk, w, st in DECODE_TILES]


def launched(cfg: dict[str, int], launch: str) -> dict[str, int]:
    """``pick_blocks``-style ``cfg`` as ``launch`` runs it (gate/up: ``_gate_up_config``)."""
    from engine.layers.moe.fused_moe import _gate_up_config

    return tiles(_gate_up_config(cfg) if launch == "gate_up" else cfg)


def tier_configs(launch: str, experts: int) -> list[dict[str, int]]:
    """Each ``pick_blocks`` tier (at 1, 32 and 128 slots an expert) and ``OLD_MIDDLE_TIER``, as
    ``launch`` runs them."""
    from engine.layers.moe.fused_moe import pick_blocks

    own = [pick_blocks(experts * per_expert, experts) for per_expert in (1, 32, 128)] + [OLD_MIDDLE_TIER]
    return [launched(cfg, launch) for cfg in own]


def with_group_m(configs: list[dict[str, int]], group_ms: list[int] | None) -> list[dict[str, int]]:
    """Each config once per ``GROUP_M`` in ``group_ms`` (``--group-m``), in order, without
    repeats; ``configs`` unchanged without it."""
    if not group_ms:
        return configs
    out: list[dict[str, int]] = []
    for cfg in configs:
        for group_m in group_ms:
            variant = {**cfg, "GROUP_M": group_m}
            if variant not in out:
                out.append(variant)
    return out


def sweep(shape: str, tokens: int, routings: int, top: int, prefill: bool = False,
          tiers: bool = False, group_ms: list[int] | None = None) -> list[dict[str, object]]:
    from engine.layers.moe.align import align_slots_by_expert
    from engine.layers.moe.fused_moe import _grouped_gemm, pick_blocks

    experts, hidden, inter, top_k = SHAPES[shape]
    dtype, dev = torch.bfloat16, "cuda"
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dtype) * 0.02
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    slots = tokens * top_k
    act = torch.randn(slots, inter, device=dev, dtype=dtype)
    out_act = torch.empty(slots, inter, device=dev, dtype=dtype)
    out_down = torch.empty(slots, hidden, device=dev, dtype=dtype)
    weights = torch.rand(slots, device=dev, dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    ids = [torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(dev)
           for _ in range(routings)]
    touched = sum(len(torch.unique(i)) for i in ids) / routings
    bytes_up = touched * 2 * inter * hidden * 2
    bytes_down = touched * hidden * inter * 2
    picked = pick_blocks(slots, experts)
    # Each launch's tiles as fused_moe runs them (gate/up: half of BLOCK_N for each of its two
    # accumulators, and its own stages where given).
    current_cfg = {launch: launched(picked, launch) for launch in ("gate_up", "down")}
    rows: list[dict[str, object]] = []
    aligned: dict[int, list] = {}
    for launch in ("gate_up", "down"):
        results = []
        own = tier_configs(launch, experts) if tiers else None
        for cfg in with_group_m(candidates(prefill, tiles(picked), list(current_cfg.values()), own), group_ms):
            bm = cfg["BLOCK_M"]
            blocks = aligned.setdefault(bm, [align_slots_by_expert(i, experts, bm) for i in ids])
            if launch == "gate_up":
                calls = [lambda b=b, c=cfg: _grouped_gemm(x, w13, None, out_act, b, top_k, None, c, silu_mul=True)
                         for b in blocks]
            else:
                calls = [lambda b=b, c=cfg: _grouped_gemm(act, w2, None, out_down, b, 1, weights, c) for b in blocks]
            try:
                us = graph_median_us(calls)
            except Exception as exc:  # noqa: BLE001 - out of shared memory or registers: not a candidate
                print(f"  skip {launch} {cfg}: {type(exc).__name__}", flush=True)
                continue
            results.append((us, cfg))
        results.sort(key=lambda r: r[0])
        current = next((us for us, c in results if c == current_cfg[launch]), None)
        nbytes = bytes_up if launch == "gate_up" else bytes_down
        flops = 2 * slots * hidden * inter * (2 if launch == "gate_up" else 1)
        for rank, (us, cfg) in enumerate(results[:top]):
            row = {"bench": "moe_tile_sweep", "shape": shape, "tokens": tokens, "launch": launch, "rank": rank,
                   "us": round(us, 2), "gbs": round(nbytes / us / 1e3, 1),
                   "tflops": round(flops / us / 1e6, 1), "current_us": round(current, 2) if current else None,
                   "config": cfg, "gpu": torch.cuda.get_device_name(),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            rows.append(row)
            print(f"{shape} T={tokens:4d} {launch:7s} #{rank} {us:7.2f} us {row['gbs']:7.1f} GB/s {row['tflops']:6.1f} TFLOP/s  "
                  f"(current {row['current_us']} us)  {cfg}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--routings", type=int, default=None,
                    help="distinct routings cycled per graph (default 16; 2 with --prefill)")
    ap.add_argument("--prefill", action="store_true", help="sweep BLOCK_M too, over tensor-core tiles for prefill")
    ap.add_argument("--tiers", action="store_true", help="time pick_blocks' own tiers only (and the old middle one)")
    ap.add_argument("--group-m", nargs="+", type=int, default=None,
                    help="time each config with each of these GROUP_M (the program order over M blocks)")
    ap.add_argument("--top", type=int, default=5, help="configs printed per launch")
    ap.add_argument("--result-file", default=None, help="append one JSON line per printed config")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_moe_tiles.py: needs a CUDA GPU")
    for tokens in args.tokens:
        routings = args.routings or (2 if args.prefill else 16)
        rows = sweep(args.shape, tokens, routings, args.top, args.prefill, args.tiers, args.group_m)
        append_rows(args.result_file, *rows)


if __name__ == "__main__":
    main()
