"""Times the MLA decode kernel at DeepSeek-V2-Lite's shape against the latent-read bound.

Run from the repository root on a CUDA GPU:

    PYTHONPATH=core/src:plugins-attention/triton/src \\
        python3 plugins-attention/triton/benchmarks/bench_mla_decode.py [--sweep] [--check]

DeepSeek-V2-Lite's attention after weight absorption: 16 query heads over one latent KV head of
512 + 64 dims (``kv_lora_rank`` + rope), V the latent's leading 512 dims. Every row is ``--ctx``
tokens long on a page-size-1 pool with shuffled slots. The bytes a call must move are each cached
token's 576-dim row once (it serves all 16 heads and V too) plus its int32 slot; a line reports
them over the median time as GB/s and as a fraction of ``--peak`` (4.29 TB/s: an H200's copy
rate; the copy rate measured on this GPU is printed too). Calls moving less than ``GRAPH_BELOW``
bytes run inside a CUDA graph over copies of the inputs larger than L2 together (no launch gaps,
data from HBM, as when serving); larger ones run eagerly (``do_bench`` clears L2 first).

Each (batch, ctx) times the backend's defaults (``MLA_DECODE_BLOCK_H`` heads a program, the split
count ``choose_num_kv_splits`` gives for ``mla_head_blocks`` programs a row, at most 16). ``--sweep``
also times a grid of (block_h, block_n, warps, stages) at half, twice and four times that split
count (up to 64); ``--variants`` the loop and fp8 widening variants of ``VARIANTS``; ``--splits``
given split counts with the default tiles (a CUDA graph at batch 1 always runs 16: at 192 tokens on
an H200 that is 8.0 us with the merge against 7.8 at 8 splits and 11.7 at one, without a merge). ``--check``
first compares one call of each dtype with the float64 torch reference (also runs on the CPU under
``TRITON_INTERPRET=1``, at the smallest sizes given).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys

import torch
import triton
from engine_attention_triton.decode_attention import choose_num_kv_splits
from engine_attention_triton.mla_attention import (
    MLA_DECODE_BLOCK_H,
    mla_decode_fwd,
    mla_head_blocks,
)
from engine_attention_triton.reference import reference_decode

NUM_HEADS, LORA, ROPE = 16, 512, 64  # DeepSeek-V2-Lite
DIM = LORA + ROPE
SCALE = (128 + 64) ** -0.5  # 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
#: The backend's default cap is 16 (``triton.max_kv_splits``); the sweep looks beyond it, since a
#: batch-1 row of MLA is one program a split (16 heads in one block) where MHA has one per KV head.
MAX_SPLITS = 64
GRAPH_BELOW = 256 << 20
#: (block_h, block_n, num_warps, num_stages) tried by --sweep.
GRID = list(itertools.product((16, 32), (16, 32, 64), (4, 8), (1, 2, 3)))
#: Loops and widenings timed by --variants beside the default (fp8 under bf16 queries: the default
#: gathers int32 words and widens them on the integer pipe; "cvt" is Triton's own e4m3 -> bf16
#: widening, "f16" the pair conversion to float16 with q converted; bf16: the plain loop).
VARIANTS = {
    "fp8_e4m3": {
        "cvt plain w8 s2": dict(widen="cvt", slots_ahead=False, num_warps=8, num_stages=2),
        "f16 plain w8 s2": dict(widen="f16", slots_ahead=False, num_warps=8, num_stages=2),
        "f16 ahead w8 s4": dict(widen="f16", slots_ahead=True, num_warps=8, num_stages=4),
    },
    "bf16": {
        "plain w4 s2": dict(slots_ahead=False, num_warps=4, num_stages=2),
    },
}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


class Problem:
    """``copies`` independent decode batches of ``bs`` rows of ``ctx`` tokens over one pool dtype."""

    def __init__(self, dtype: torch.dtype, bs: int, ctx: int, graphs: bool = True, heads: int = NUM_HEADS) -> None:
        self.bs, self.ctx, self.dtype, self.heads = bs, ctx, dtype, heads
        self.kv_scale = 0.5 if dtype.itemsize == 1 else 1.0  # an fp8 pool's per-layer scale
        elem = torch.empty(0, dtype=dtype).element_size()
        self.bytes = bs * ctx * (DIM * elem + 4)
        small = graphs and self.bytes < GRAPH_BELOW
        self.copies = max(1, -(-(160 << 20) // self.bytes)) if small else 1
        total = bs * ctx
        self.inputs = []
        for _ in range(self.copies):
            kv = (torch.randn(total + 1, 1, DIM, device=DEV) * 0.5).to(dtype)
            slots = (torch.randperm(total, device=DEV) + 1).to(torch.int32).view(bs, ctx)
            q = torch.randn(bs, heads, DIM, dtype=torch.bfloat16 if DEV == "cuda" else torch.float32,
                            device=DEV)
            self.inputs.append((q, kv, q.new_empty(bs, heads, LORA), slots))
        self.reqs = torch.arange(bs, device=DEV)
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int64, device=DEV)
        self.part_out = torch.empty(bs, heads, MAX_SPLITS, LORA, dtype=torch.float32, device=DEV)
        self.part_lse = torch.empty(bs, heads, MAX_SPLITS, dtype=torch.float32, device=DEV)

    def call(self, i: int, splits: int, tiles: dict):
        q, kv, out, slots = self.inputs[i]
        return lambda: mla_decode_fwd(q, kv, out, slots, self.reqs, self.seq_lens, self.part_out,
                                      self.part_lse, splits, SCALE, LORA, kv_scale=self.kv_scale, **tiles)

    def check(self, splits: int) -> str:
        q, kv, out, slots = self.inputs[0]
        self.call(0, splits, {})()
        wide = kv.double() * self.kv_scale
        ref = reference_decode(q, wide, wide[..., :LORA], slots, self.reqs, self.seq_lens, SCALE)
        err = (out.double() - ref).abs().max().item()
        limit = 2e-2 if q.dtype == torch.bfloat16 else 1e-4
        if not err <= limit:
            raise SystemExit(f"check failed: bs={self.bs} ctx={self.ctx} {self.dtype}: max abs err {err:.3g} > {limit}")
        return f"# check bs={self.bs} ctx={self.ctx} {self.dtype} splits={splits}: max abs err {err:.2g} (limit {limit})"

    def time_ms(self, splits: int, tiles: dict) -> float:
        from triton.testing import do_bench

        calls = [self.call(i, splits, tiles) for i in range(self.copies)]
        for call in calls:  # compile outside any capture
            call()
        torch.cuda.synchronize()
        if self.copies == 1:
            return float(do_bench(calls[0], warmup=25, rep=100, return_mode="median"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        return float(do_bench(graph.replay, warmup=25, rep=100, return_mode="median")) / self.copies


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB: bytes read plus written over time."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e9


def line(name: str, prob: Problem, label: str, splits: int, ms: float, peak: float) -> str:
    gbs = prob.bytes / (ms * 1e-3) / 1e9
    return (f"{name:<8} bs={prob.bs:<4} ctx={prob.ctx:<5} {label:<22} splits={splits:<2} "
            f"{ms * 1e3:9.1f} us {gbs:6.0f} GB/s {gbs / peak:5.2f} of peak  bound {prob.bytes / peak / 1e3:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--ctx", type=int, nargs="+", default=[1024, 2048, 4096], help="tokens per row")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--heads", type=int, default=NUM_HEADS,
                        help="query heads on the rank (16: V2-Lite; 128: V3 whole, as under DP attention)")
    parser.add_argument("--peak", type=float, default=4290.0, help="GB/s the fractions are of")
    parser.add_argument("--sweep", action="store_true", help="also time the tile grid and split counts")
    parser.add_argument("--check", action="store_true", help="compare with the torch reference first")
    parser.add_argument("--splits", type=int, nargs="+", default=[],
                        help="also time these split counts (1..64) with the default tiles (1: no merge launch)")
    parser.add_argument("--variants", action="store_true",
                        help="also time the loop and widening variants of VARIANTS at the default split count")
    args = parser.parse_args()
    if DEV == "cpu":
        from engine_attention_triton.interpreter_compat import patch_interpreter_index

        patch_interpreter_index()
    if args.check:
        for name in args.dtypes:
            prob = Problem(DTYPES[name], min(args.batch_sizes), min(args.ctx), graphs=False, heads=args.heads)
            print(prob.check(min(3, MAX_SPLITS)), flush=True)
        if DEV != "cuda":
            return
    if DEV != "cuda":
        raise SystemExit("timing needs a CUDA GPU (--check alone runs under TRITON_INTERPRET=1)")
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {props.name}, {num_sms} SMs, torch {torch.__version__}, triton {triton.__version__}, "
          f"{now:%Y-%m-%d %H:%M} UTC; copy {copy_bandwidth_gbs():.0f} GB/s (read + write); "
          f"fractions of {args.peak:.0f} GB/s; {args.heads} heads, {LORA}+{ROPE} latent", flush=True)
    programs = mla_head_blocks(args.heads, MLA_DECODE_BLOCK_H)
    for name, bs, ctx in itertools.product(args.dtypes, args.batch_sizes, args.ctx):
        prob = Problem(DTYPES[name], bs, ctx, heads=args.heads)
        default = choose_num_kv_splits(bs, programs, num_sms, 16, ctx)
        print(line(name, prob, "default", default, prob.time_ms(default, {}), args.peak), flush=True)
        for splits in args.splits:
            if not 1 <= splits <= MAX_SPLITS:
                raise SystemExit(f"--splits: invalid value {splits}; accepted: 1..{MAX_SPLITS}")
            print(line(name, prob, "split count", splits, prob.time_ms(splits, {}), args.peak), flush=True)
        if args.variants:
            for label, tiles in VARIANTS.get(name, {}).items():
                print(line(name, prob, label, default, prob.time_ms(default, tiles), args.peak), flush=True)
        if args.sweep:
            for block_h, block_n, warps, stages in GRID:
                tiles = dict(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)
                for splits in sorted({max(1, default // 2), default, *(min(MAX_SPLITS, f * default) for f in (2, 4))}):
                    ms = prob.time_ms(splits, tiles)
                    label = f"h{block_h} n{block_n} w{warps} s{stages}"
                    print(line(name, prob, label, splits, ms, args.peak), flush=True)
        del prob
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
