"""Times the Triton decode kernel over a bf16 and an fp8 KV pool against the KV-read bound.

Run from the repository root on a CUDA GPU:

    PYTHONPATH=core/src:plugins-attention/triton/src \\
        python3 plugins-attention/triton/benchmarks/bench_decode.py [--sweep] [--batch-sizes 1 64 256 512]

Llama-3-8B heads (32 query heads on 8 KV heads, head dim 128), every row ``--ctx`` tokens long
on a page-size-1 pool whose slots are shuffled (each block of keys is a gather of 128- or
256-byte rows; ``--slots rows`` gives each row consecutive slots instead). The bytes a call must
move are the K and V of every cached token once plus the int32 slot of each; a line reports them
over the median time as GB/s and as a fraction of
``--peak`` (4.29 TB/s: the device-to-device copy rate an H200 reaches, also printed as
measured). Calls that move less than ``GRAPH_BELOW`` bytes run inside a CUDA graph over copies
of the inputs larger than L2 together (no launch gaps, data from HBM, as when serving); larger
ones run eagerly (``triton.testing.do_bench``, which clears L2 first).

Each batch size times the kernel's default tiles and split count for the pool's dtype (see
``decode_tiles``), and the tiles given with ``--tiles`` (each also reports its output's largest
difference from the default's). ``--mma N,R`` also times ``decode_fp8_mma_fwd`` (an fp8 pool, one split) with N keys a block and
a register cap R. ``--both-orders`` also times the default tiles in both launch
orders (``heads_inner`` 0 and 1). ``--sweep`` first times every tile in ``GRID`` at the largest batch size, then also the best
``--top`` of them at every batch size; batches of 128 rows or more also try one and two splits.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import multiprocessing
import sys

import torch
import triton
from bench_kernels import DEV, copy_bandwidth_gbs, median_ms  # the script's folder is on sys.path
from engine_attention_triton.decode_attention import choose_num_kv_splits, decode_attention_fwd

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
MAX_SPLITS = 16
GRAPH_BELOW = 256 << 20
#: (slots_ahead, block_n, num_warps, num_stages) tried by --sweep.
GRID = ([(0, bn, 4, 3) for bn in (32, 64)]
        + [(1, bn, w, s) for bn, w, s in itertools.product((32, 64), (1, 2, 4), (2, 3, 4))])


class Problem:
    """``copies`` independent decode batches of ``bs`` rows of ``ctx`` tokens over one pool dtype."""

    def __init__(self, dtype: torch.dtype, bs: int, ctx: int, slots: str = "shuffled") -> None:
        self.bs, self.ctx, self.dtype = bs, ctx, dtype
        elem = torch.empty(0, dtype=dtype).element_size()
        self.bytes = bs * ctx * (NUM_KV_HEADS * HEAD_DIM * 2 * elem + 4)
        self.copies = max(1, -(-(160 << 20) // self.bytes)) if self.bytes < GRAPH_BELOW else 1
        self.inputs = []
        total = bs * ctx
        for _ in range(self.copies):
            k = torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, device=DEV).to(dtype)
            v = torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, device=DEV).to(dtype)
            if slots == "rows":  # each row's tokens in consecutive slots (as a prompt's prefill takes them)
                rows = (torch.randperm(bs, device=DEV) * ctx)[:, None] + torch.arange(ctx, device=DEV)
                slots = (rows + 1).to(torch.int32)
            else:
                slots = (torch.randperm(total, device=DEV) + 1).to(torch.int32).view(bs, ctx)
            q = torch.randn(bs, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEV)
            self.inputs.append((q, k, v, torch.empty_like(q), slots))
        self.reqs = torch.arange(bs, device=DEV)
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int64, device=DEV)
        self.part_out = torch.empty(bs, NUM_HEADS, MAX_SPLITS, HEAD_DIM, dtype=torch.float32, device=DEV)
        self.part_lse = torch.empty(bs, NUM_HEADS, MAX_SPLITS, dtype=torch.float32, device=DEV)

    def call(self, i: int, splits: int, tiles: dict):
        q, k, v, out, slots = self.inputs[i]
        return lambda: decode_attention_fwd(q, k, v, out, slots, self.reqs, self.seq_lens, self.part_out,
                                            self.part_lse, splits, HEAD_DIM**-0.5, pdl=True, **tiles)

    def call_mma(self, i: int, block_n: int, maxnreg: int):
        from engine_attention_triton.decode_fp8_mma import decode_fp8_mma_fwd  # Gluon: --mma only

        q, k, v, out, slots = self.inputs[i]
        return lambda: decode_fp8_mma_fwd(q, k, v, out, slots, self.reqs, self.seq_lens, HEAD_DIM**-0.5, pdl=True,
                                          block_n=block_n, maxnreg=maxnreg)

    def diff(self, splits: int, tiles: dict) -> float:
        """Largest |difference| of the output from the default tiles' at the default split count
        (both round to bf16: a layout or masking error shows as O(1), rounding as ~1e-2)."""
        out = self.inputs[0][3]
        if not hasattr(self, "expected"):
            self.call(0, choose_num_kv_splits(self.bs, NUM_KV_HEADS, torch.cuda.get_device_properties(0)
                                              .multi_processor_count, MAX_SPLITS, self.ctx), {})()
            self.expected = out.float().clone()
        out.fill_(float("nan"))
        (self.call_mma(0, *tiles["mma"]) if "mma" in tiles else self.call(0, splits, tiles))()
        return float((out.float() - self.expected).abs().max())

    def time_ms(self, splits: int, tiles: dict) -> float:
        """Median ms of a call with ``tiles`` (``{"mma": (block_n, maxnreg)}``: ``decode_fp8_mma_fwd``)."""
        calls = [self.call_mma(i, *tiles["mma"]) if "mma" in tiles else self.call(i, splits, tiles)
                 for i in range(self.copies)]
        for call in calls:  # compile outside any capture
            call()
        torch.cuda.synchronize()
        if self.copies == 1:
            return median_ms(calls[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        return median_ms(graph.replay) / self.copies


def tiles_of(cfg: tuple) -> dict:
    tiles = dict(slots_ahead=bool(cfg[0]), block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
    if len(cfg) > 4:
        tiles["words"] = int(cfg[4])
    if len(cfg) > 5:
        tiles["heads_inner"] = bool(cfg[5])
    if len(cfg) > 6:
        tiles["kv_per_program"] = int(cfg[6])
    return tiles


def _compile_worker(args: tuple) -> str:
    """Compiles (by one tiny launch) the kernels for some tiles; fills Triton's on-disk cache."""
    dtype_name, cfgs, ctx = args
    prob = Problem(DTYPES[dtype_name], 2, ctx)
    for cfg in cfgs:
        for splits in (1, 2):
            prob.call(0, splits, tiles_of(cfg))()
    torch.cuda.synchronize()
    return dtype_name


def precompile(dtype_names: list[str], cfgs: list[tuple], ctx: int, procs: int) -> None:
    jobs = [(d, cfgs[i::procs], ctx) for d in dtype_names for i in range(procs) if cfgs[i::procs]]
    with multiprocessing.get_context("spawn").Pool(min(procs, len(jobs))) as pool:
        list(pool.imap_unordered(_compile_worker, jobs))


def line(name: str, prob: Problem, label: str, splits: int, ms: float, peak: float, diff: float | None = None) -> str:
    gbs = prob.bytes / (ms * 1e-3) / 1e9
    return (f"{name:<8} bs={prob.bs:<4} ctx={prob.ctx:<5} {label:<28} splits={splits:<2} "
            f"{ms * 1e3:9.1f} us {gbs:6.0f} GB/s {gbs / peak:5.2f} of peak  bound {prob.bytes / peak / 1e3:8.1f} us"
            + ("" if diff is None else f"  max|diff| {diff:.2g}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time the tile grid, then the best at every batch")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256, 512])
    parser.add_argument("--ctx", type=int, default=1552, help="tokens per row")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--slots", choices=("shuffled", "rows"), default="shuffled",
                        help="rows: each row's tokens in consecutive pool slots instead of shuffled ones")
    parser.add_argument("--peak", type=float, default=4290.0, help="GB/s the fractions are of")
    parser.add_argument("--tiles", nargs="*", default=[], metavar="A,N,W,S[,WORDS[,HEADS_INNER[,P]]]",
                        help="also time these tiles (slots_ahead 0/1, block_n, warps, stages, fp8 words 0/1/2/3 "
                             "(2: hardware widening to float16, 3: the same on words, in inline PTX), launch order 0/1 (1: a row's KV heads together), "
                             "KV heads per program)")
    parser.add_argument("--mma", nargs="*", default=[], metavar="N,R",
                        help="fp8: also time decode_fp8_mma_fwd (one split) with N keys a block and a register cap R "
                             "(0: none)")
    parser.add_argument("--both-orders", action="store_true",
                        help="also time the default tiles in both launch orders (heads_inner 0 and 1)")
    parser.add_argument("--top", type=int, default=5, help="--sweep: tiles carried to every batch size")
    parser.add_argument("--procs", type=int, default=12, help="--sweep: processes compiling the grid")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {props.name}, {num_sms} SMs, torch {torch.__version__}, triton {triton.__version__}, "
          f"{now:%Y-%m-%d %H:%M} UTC; copy {copy_bandwidth_gbs():.0f} GB/s (read + write); "
          f"fractions of {args.peak:.0f} GB/s", flush=True)
    given = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    if args.sweep or len(given) > 1:
        precompile(args.dtypes, (GRID if args.sweep else []) + given, args.ctx, args.procs)
    peak = args.peak
    for name in args.dtypes:
        dtype = DTYPES[name]
        best: list[tuple] = list(given)
        if args.sweep:
            big = Problem(dtype, max(args.batch_sizes), args.ctx, args.slots)
            splits = choose_num_kv_splits(big.bs, NUM_KV_HEADS, num_sms, MAX_SPLITS, args.ctx)
            timed = []
            for cfg in GRID:
                ms = big.time_ms(splits, tiles_of(cfg))
                timed.append((ms, cfg))
                print(line(name, big, "grid " + str(cfg), splits, ms, peak), flush=True)
            best += [cfg for _, cfg in sorted(timed)[: args.top]]
            del big
        for bs in args.batch_sizes:
            prob = Problem(dtype, bs, args.ctx, args.slots)
            default = choose_num_kv_splits(bs, NUM_KV_HEADS, num_sms, MAX_SPLITS, args.ctx)
            print(line(name, prob, "default", default, prob.time_ms(default, {}), peak), flush=True)
            for order in (0, 1) if args.both_orders else ():
                print(line(name, prob, f"default heads_inner={order}", default,
                           prob.time_ms(default, {"heads_inner": bool(order)}), peak,
                           prob.diff(default, {"heads_inner": bool(order)})), flush=True)
            for spec in args.mma if name == "fp8_e4m3" else ():
                tiles = {"mma": tuple(int(x) for x in spec.split(","))}
                print(line(name, prob, f"mma {spec}", 1, prob.time_ms(1, tiles), peak, prob.diff(1, tiles)),
                      flush=True)
            for cfg in best:
                for splits in sorted({default, 1, 2} if bs >= 128 else {default}):
                    ms = prob.time_ms(splits, tiles_of(cfg))
                    print(line(name, prob, str(cfg), splits, ms, peak, prob.diff(splits, tiles_of(cfg))), flush=True)
            del prob
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
