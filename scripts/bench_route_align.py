"""Times the MoE routing launches at decode batch sizes (GPU only), inside a CUDA graph.

For each token count: ``route_and_align_triton`` (softmax top-k, local ids and the slot alignment
in one program), the two separate launches it replaces (``select_experts_triton``: one program
per token, then ``align_slots_triton``: one program), each of those alone, and the router alone
as the small-batch expert path uses it (no alignment). The choice of ``route_align_applies``'s
cap comes from this table.

usage: python scripts/bench_route_align.py [--experts 128] [--top-k 8] [--tokens 1 2 4 8 16 32 64]
       [--result-file out/results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from engine_platform_cuda.graph_timing import graph_median_us


def _row(tokens: int, experts: int, top_k: int) -> dict[str, object]:
    from engine.layers.moe.align_kernel import align_slots_triton
    from engine.layers.moe.fused_moe import pick_blocks
    from engine.layers.moe.route_align_kernel import route_and_align_triton
    from engine.layers.moe.router_kernel import select_experts_triton

    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
    block_m = pick_blocks(tokens * top_k, experts)["BLOCK_M"]
    _, ids = select_experts_triton(logits, top_k, True)
    return {"bench": "route_align", "tokens": tokens, "experts": experts, "top_k": top_k, "block_m": block_m,
            "fused_us": graph_median_us([lambda: route_and_align_triton(logits, top_k, True, block_m)] * 8),
            "separate_us": graph_median_us([lambda: align_slots_triton(select_experts_triton(logits, top_k, True)[1],
                                                                       experts, block_m)] * 8),
            "router_us": graph_median_us([lambda: select_experts_triton(logits, top_k, True)] * 8),
            "align_us": graph_median_us([lambda: align_slots_triton(ids, experts, block_m)] * 8),
            "gpu": torch.cuda.get_device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    for tokens in a.tokens:
        row = _row(tokens, a.experts, a.top_k)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
        if a.result_file:
            with open(a.result_file, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
