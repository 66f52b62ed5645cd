"""Programmatic dependent launch (PDL) on a decode-like chain of skinny GEMMs (GPU, sm_90+).

A batch-1 decode step is a chain of hundreds of short kernels, each waiting for the last. With
PDL a kernel is launched while its predecessor drains: its programs become resident, request
their first weight tile (weights are no kernel's output) and then wait for the predecessor's
results (``griddepcontrol.wait``). This script times a chain of ``--layers`` x (qkv projection ->
o_proj -> router) skinny GEMMs at M = 1, each reading the previous one's output, captured in a
CUDA graph, with PDL off and on, and checks that eager runs of the two give equal outputs (PDL
changes the schedule, not the arithmetic; test_gemv_kernel.py checks a captured chain). Weights are distinct per layer (cold in L2, as in a model).

usage: python scripts/bench_pdl.py [--layers 48] [--hidden 2048 --q-size 4096 --kv-size 512 --router 128] [--rows 1 4]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from engine_platform_cuda.gemv import skinny_linear, supports_pdl
from engine_platform_cuda.graph_timing import graph_median_us

from engine.bench.results import append_rows


def _chain(weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], x: torch.Tensor,
           pdl: bool) -> torch.Tensor:
    """Per layer: qkv = h W_qkv^T; h = qkv[:, :q] W_o^T (q = W_o's K); router(h) on the side."""
    h = x
    for w_qkv, w_o, w_router in weights:
        qkv = skinny_linear(h, w_qkv, pdl=pdl)
        h = skinny_linear(qkv[:, : w_o.shape[1]], w_o, pdl=pdl)
        skinny_linear(h, w_router, pdl=pdl)
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--q-size", type=int, default=4096)
    ap.add_argument("--kv-size", type=int, default=512)
    ap.add_argument("--router", type=int, default=128, help="router outputs (experts); defaults: Qwen3-30B-A3B")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    if not supports_pdl():
        raise SystemExit("bench_pdl.py: needs a CUDA GPU of compute capability 9.0 or newer")
    shapes = [(args.q_size + 2 * args.kv_size, args.hidden), (args.hidden, args.q_size), (args.router, args.hidden)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5 for n, k in shapes]
               for _ in range(args.layers)]
    nbytes = sum(w.numel() * 2 for layer in weights for w in layer)
    for rows in args.rows:
        x = torch.randn(rows, shapes[0][1], device="cuda", dtype=torch.bfloat16, generator=gen)
        off_ms = graph_median_us([lambda x=x: _chain(weights, x, False)], reps=30) / 1e3
        on_ms = graph_median_us([lambda x=x: _chain(weights, x, True)], reps=30) / 1e3
        off_out, on_out = _chain(weights, x, False), _chain(weights, x, True)
        row = {"bench": "pdl_chain", "rows": rows, "layers": args.layers, "shapes": [f"{n}x{k}" for n, k in shapes],
               "launches": args.layers * len(shapes), "off_ms": round(off_ms, 4), "on_ms": round(on_ms, 4),
               "speedup": round(off_ms / on_ms, 3), "off_tbs": round(nbytes / off_ms / 1e9, 3),
               "on_tbs": round(nbytes / on_ms / 1e9, 3), "equal": bool(torch.equal(off_out, on_out)),
               "gpu": torch.cuda.get_device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        print(json.dumps(row), flush=True)
        append_rows(args.result_file, row)


if __name__ == "__main__":
    main()
