"""Times a decode step's attention as the triton backend runs it: the CUDA platform's prologue
(``qkv_prologue``) then the split kernel and merge (three launches), against the one-launch
``decode_attention_prologue_fwd``, at Qwen3-30B-A3B's heads (32 query heads on 4 KV heads of 128).

Run from the repository root on a GPU machine (sm_90+ for ``--pdl``):

    python3 scripts/bench_decode_prologue.py [--batch 1 8] [--context 256 2048] [--splits 16 4 1]

Each variant is launched ``--calls`` times in one CUDA graph (``graph_timing.graph_median_us``),
one after another as a model's layers launch them (with ``--pdl`` each waits for the one before),
so the figure is one layer's attention latency, launch gaps included. No projections run between
them, so nothing streams weights meanwhile: this isolates the attention chain, it is not a
decode step.
"""

from __future__ import annotations

import argparse

import torch
from engine_attention_triton.decode_attention import decode_attention_fwd
from engine_attention_triton.decode_prologue import decode_attention_prologue_fwd
from engine_platform_cuda.graph_timing import graph_median_us
from engine_platform_cuda.prologue import qkv_prologue

HEADS, KV_HEADS, DIM = 32, 4, 128


def setup(batch: int, context: int) -> dict[str, torch.Tensor]:
    """A pool of ``batch`` rows of ``context`` positions on shuffled slots, a qkv output, rotary."""
    dev, bf16 = "cuda", torch.bfloat16
    slots = batch * context + 1
    k = torch.randn(slots, KV_HEADS, DIM, device=dev).to(bf16)
    v = torch.randn(slots, KV_HEADS, DIM, device=dev).to(bf16)
    r2t = (torch.randperm(slots - 1, device=dev) + 1).to(torch.int32).view(batch, context)
    seq = torch.full((batch,), context, dtype=torch.int64, device=dev)
    inv = 1.0 / (1e6 ** (torch.arange(0, DIM, 2, device=dev).float() / DIM))
    freqs = torch.outer(torch.arange(8192, device=dev).float(), inv)
    return {"k": k, "v": v, "r2t": r2t, "idx": torch.arange(batch, device=dev), "seq": seq,
            "pos": seq - 1, "loc": r2t[:, -1].to(torch.int64),
            "qkv": torch.randn(batch, (HEADS + 2 * KV_HEADS) * DIM, device=dev).to(bf16),
            "cos": freqs.cos().contiguous(), "sin": freqs.sin().contiguous(),
            "qw": torch.randn(DIM, device=dev).to(bf16), "kw": torch.randn(DIM, device=dev).to(bf16)}


def variants(t: dict[str, torch.Tensor], splits: int, pdl: bool) -> dict[str, object]:
    batch = t["qkv"].shape[0]
    q, kk, vv = t["qkv"].split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=1)
    q_work = q.clone()
    out = torch.empty(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    part_out = torch.empty(batch, HEADS, splits, DIM, device="cuda")
    part_lse = torch.empty(batch, HEADS, splits, device="cuda")
    tickets = torch.zeros(batch, KV_HEADS, dtype=torch.int32, device="cuda")
    scale = DIM**-0.5

    def three() -> None:
        qkv_prologue(t["pos"], q_work, kk, vv, t["k"], t["v"], t["loc"], t["cos"], t["sin"], DIM, t["qw"], t["kw"],
                     1e-6, pdl=pdl)
        decode_attention_fwd(q_work.view(batch, HEADS, DIM), t["k"], t["v"], out, t["r2t"], t["idx"], t["seq"],
                             part_out, part_lse, splits, scale, pdl=pdl)

    def one() -> None:
        decode_attention_prologue_fwd(q, kk, vv, out, t["k"], t["v"], t["r2t"], t["idx"], t["seq"], t["loc"],
                                      t["pos"], t["cos"], t["sin"], DIM, t["qw"], t["kw"], 1e-6, part_out,
                                      part_lse, tickets, splits, scale, pdl=pdl)

    def two() -> None:
        decode_attention_prologue_fwd(q, kk, vv, out, t["k"], t["v"], t["r2t"], t["idx"], t["seq"], t["loc"],
                                      t["pos"], t["cos"], t["sin"], DIM, t["qw"], t["kw"], 1e-6, part_out,
                                      part_lse, tickets, splits, scale, pdl=pdl, merge_in_kernel=False)

    return {"three launches": three, "one launch": one, "prologue inside, merge launch": two}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--splits", type=int, nargs="+", default=[16, 4, 1])
    ap.add_argument("--calls", type=int, default=48)
    ap.add_argument("--no-pdl", dest="pdl", action="store_false")
    args = ap.parse_args()
    print(f"{'batch':>5} {'context':>7} {'splits':>6}  {'three launches us':>17} {'one launch us':>13} "
          f"{'prologue inside, merge launch us':>32}")
    for batch in args.batch:
        for context in args.context:
            t = setup(batch, context)
            for splits in args.splits:
                got = {name: graph_median_us([fn] * args.calls) for name, fn in variants(t, splits, args.pdl).items()}
                print(f"{batch:>5} {context:>7} {splits:>6}  {got['three launches']:>17.2f} {got['one launch']:>13.2f} "
                      f"{got['prologue inside, merge launch']:>32.2f}")


if __name__ == "__main__":
    main()
