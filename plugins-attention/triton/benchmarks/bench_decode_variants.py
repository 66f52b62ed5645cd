"""Where the fp8-pool decode kernel's time goes at a large batch: variants of its stage 1 side by side.

Run from the repository root on a CUDA GPU:

    python3 plugins-attention/triton/benchmarks/bench_decode_variants.py [--bs 1024] [--ctx 1536] [VARIANT ...]

Llama-3-8B heads (32 query heads on 8 KV heads, head dim 128), every row ``--ctx`` tokens on a
page-size-1 pool with shuffled slots, one layer. Each line gives the median time (``do_bench``,
L2 cleared) and the bytes a call must read (K, V and the slot of every cached token) as GB/s and as
a fraction of ``--peak``, for:

- ``bf16 default`` / ``fp8 default``: ``decode_attention_fwd`` with its own tiles and split count;
- ``fp8 default tiles splits=P``: the default tiles at 2 and 4 splits (stage 2's merge after them);
- ``fp8 tiles A,N,W,S,WORDS,HI``: the same kernel with tiles given (``bench_decode.py --tiles``), one split;
- ``fp8 mma block_n=N maxnreg=R``: ``decode_fp8_mma_fwd`` (the operands widened in registers, Gluon),
  ``--mma N,R ...``;
- ``gather``: only the reads (``bench_gather.py``'s kernel, two 128-byte rows a token and head);
- variants of a stand-alone copy of stage 1 (one split, slots loaded a block ahead, a row's KV heads
  as consecutive programs), named ``key=value`` joined by commas:
  ``work`` 0 (gather, sum the raw words), 1 (gather and widen, sum the widened tiles), 2 (attend);
  ``cvt`` 0 (int32 words widened to bf16 on the integer pipe, q bf16), 1 (e4m3 -> float16 by the
  hardware's paired conversion, q float16), 2 (Triton's e4m3 -> bf16, through float16), 3 (int32
  words widened to float16 by the paired conversion in inline PTX, ``widen_e4m3_words_f16``, q float16);
  ``qk`` 0 (``tl.dot``, the group's query heads padded to 16 rows) or 1 (broadcast multiply and sum
  in float32 over the 4 heads, also for P times V); ``n`` keys a block; ``nw`` warps; ``ns`` stages;
  ``vl`` 1: V's gather issued after the scores instead of beside K's; ``mr`` a register cap per thread
  (Triton's ``maxnreg``: more programs resident on an SM, perhaps with spills; 0: none); ``pf`` 1: the
  next block's K/V gathered into registers (the loop carries them) instead of Triton's pipelining
  through shared memory (use with ``ns=1``): the widened tile's trip to the tensor-core layout is
  then the only one through shared memory.

Attending variants also report their output's largest difference from ``fp8 default``'s.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import sys

import torch
import triton
import triton.language as tl
from bench_gather import _gather_kernel  # the script's folder is on sys.path
from bench_kernels import median_ms
from engine_attention_triton.decode_attention import choose_num_kv_splits, decode_attention_fwd
from engine_attention_triton.decode_fp8_mma import decode_fp8_mma_fwd
from engine_attention_triton.jit_math import widen_e4m3_words, widen_e4m3_words_f16

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
GROUP = NUM_HEADS // NUM_KV_HEADS
DEFAULT_VARIANTS = [
    "work=0,cvt=3", "work=1,cvt=0", "work=1,cvt=1", "work=1,cvt=3",
    "cvt=1", "cvt=0", "cvt=3", "cvt=2",
    "work=0,cvt=3,pf=1,ns=1", "cvt=3,pf=1,ns=1", "cvt=3,pf=1,ns=1,nw=4", "cvt=3,pf=1,ns=1,n=16",
    "cvt=3,pf=1,ns=1,n=64,nw=4", "cvt=0,pf=1,ns=1", "cvt=3,pf=1,ns=1,n=16,nw=4",
    "cvt=3,nw=4", "cvt=3,n=16", "cvt=3,n=16,nw=4", "cvt=3,n=64,nw=4", "cvt=3,ns=4", "cvt=3,ns=2", "cvt=3,mr=128",
    "cvt=3,n=64,nw=4,ns=4", "cvt=3,vl=1", "cvt=3,n=16,ns=4", "cvt=3,nw=1,n=16",
    "cvt=1,mr=128", "cvt=1,n=16", "cvt=1,nw=4", "cvt=0,nw=4", "cvt=0,mr=96",
    "cvt=1,qk=1,n=16,nw=4", "cvt=3,qk=1,n=16,nw=4", "cvt=1,qk=1,n=16,nw=8",
]
#: decode_attention_fwd's tiles (slots ahead, keys a block, warps, stages, words, heads inner).
DEFAULT_TILES = ["1,16,1,3,3,1", "1,32,2,3,3,1", "1,32,2,3,2,1", "1,32,1,3,3,1", "1,16,1,4,3,1", "1,16,1,2,3,1",
                 "1,64,4,3,3,1", "1,16,2,3,3,1", "1,32,2,3,1,1"]


@triton.jit
def _widen(x, CVT: tl.constexpr):
    if CVT == 0:
        return widen_e4m3_words(x)
    elif CVT == 1:
        return x.to(tl.float16)
    elif CVT == 2:
        return x.to(tl.bfloat16)
    else:
        return widen_e4m3_words_f16(x)


@triton.jit
def _variant_kernel(Q, K, V, Slots, Out, sm_scale, stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ob, stride_oh, CTX: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_N: tl.constexpr, D: tl.constexpr, WORK: tl.constexpr, CVT: tl.constexpr,
                    QK: tl.constexpr, VL: tl.constexpr, PF: tl.constexpr):
    kv_head = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    heads = kv_head * GROUP + offs_h
    q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_h < GROUP)[:, None], other=0.0)
    if CVT == 1 or CVT == 3:
        q = q.to(tl.float16)  # the benchmark's q is far inside float16's range
    if QK == 1:
        q = q.to(tl.float32)
    # CVT 0 and 3: K and V are int32 views (strides in words).
    cols = tl.arange(0, D // 4) if CVT == 0 or CVT == 3 else offs_d
    k_base = K + kv_head * stride_kh + cols[None, :]
    v_base = V + kv_head * stride_vh + cols[None, :]
    slots = Slots + row * CTX
    loc_nx = tl.load(slots + tl.arange(0, BLOCK_N))
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    raw = tl.zeros([D // 4], tl.int32)
    wide = tl.zeros([BLOCK_N, D], tl.float16 if CVT == 1 or CVT == 3 else tl.bfloat16)
    scale = sm_scale * 1.4426950408889634
    if PF:
        loc = loc_nx.to(tl.int64)
        k_nx = tl.load(k_base + loc[:, None] * stride_kt)
        v_nx = tl.load(v_base + loc[:, None] * stride_vt)
        offs_nx = BLOCK_N + tl.arange(0, BLOCK_N)
        loc_nx = tl.load(slots + offs_nx, mask=offs_nx < CTX, other=0)
    for start in range(0, CTX, BLOCK_N):
        if PF:
            # The next block's K/V gathered into registers while this one is attended.
            k = k_nx
            v = v_nx
            live = (start + BLOCK_N + tl.arange(0, BLOCK_N)) < CTX
            loc = loc_nx.to(tl.int64)
            k_nx = tl.load(k_base + loc[:, None] * stride_kt, mask=live[:, None], other=0)
            v_nx = tl.load(v_base + loc[:, None] * stride_vt, mask=live[:, None], other=0)
            offs_nx = start + 2 * BLOCK_N + tl.arange(0, BLOCK_N)
            loc_nx = tl.load(slots + offs_nx, mask=offs_nx < CTX, other=0)
        else:
            loc = loc_nx.to(tl.int64)
            offs_nx = start + BLOCK_N + tl.arange(0, BLOCK_N)
            loc_nx = tl.load(slots + offs_nx, mask=offs_nx < CTX, other=0)
            k = tl.load(k_base + loc[:, None] * stride_kt)
            if VL == 0:
                v = tl.load(v_base + loc[:, None] * stride_vt)
        if WORK == 0:
            raw += tl.sum(k + v, 0)
        else:
            kw = _widen(k, CVT)
            if WORK == 1:
                wide += kw + _widen(v, CVT)
            else:
                if QK == 0:
                    qk = tl.dot(q.to(kw.dtype), tl.trans(kw)) * scale
                else:
                    qk = tl.sum(q[:, None, :] * kw.to(tl.float32)[None, :, :], 2) * scale
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if VL == 1:
                    v = tl.load(v_base + loc[:, None] * stride_vt)
                vw = _widen(v, CVT)
                if QK == 0:
                    acc = acc * alpha[:, None] + tl.dot(p.to(vw.dtype), vw)
                else:
                    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vw.to(tl.float32)[None, :, :], 1)
                m_i = m_new
    if WORK == 0:
        acc += tl.sum(raw.to(tl.float32), 0)
    elif WORK == 1:
        acc += tl.sum(tl.sum(wide.to(tl.float32), 1), 0)
    else:
        acc = acc / l_i[:, None]
    tl.store(Out + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], acc.to(Out.dtype.element_ty),
             mask=(offs_h < GROUP)[:, None])


def parse_variant(spec: str) -> dict[str, int]:
    cfg = {"work": 2, "cvt": 1, "qk": 0, "n": 32, "nw": 2, "ns": 3, "vl": 0, "mr": 0, "pf": 0}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in cfg:
            raise SystemExit(f"variant {spec!r}: unknown key {key!r}; accepted: {', '.join(cfg)}")
        cfg[key] = int(value)
    if cfg["pf"] and cfg["vl"]:
        raise SystemExit(f"variant {spec!r}: pf=1 gathers V beside K")
    if cfg["work"] == 0 and cfg["cvt"] not in (0, 3):
        raise SystemExit(f"variant {spec!r}: work=0 sums the raw words: it needs cvt=0 or 3")
    return cfg


class Pool:
    """One layer's shuffled page-size-1 pool for ``bs`` rows of ``ctx`` tokens, q and outputs."""

    def __init__(self, dtype: torch.dtype, bs: int, ctx: int) -> None:
        self.bs, self.ctx = bs, ctx
        total = bs * ctx
        self.k = torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
        self.v = torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
        self.slots = (torch.randperm(total, device="cuda") + 1).to(torch.int32).view(bs, ctx)
        self.q = torch.randn(bs, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        self.out = torch.empty_like(self.q)
        self.reqs = torch.arange(bs, device="cuda")
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int64, device="cuda")
        self.part_out = torch.empty(bs, NUM_HEADS, 16, HEAD_DIM, dtype=torch.float32, device="cuda")
        self.part_lse = torch.empty(bs, NUM_HEADS, 16, dtype=torch.float32, device="cuda")
        self.bytes = total * NUM_KV_HEADS * (2 * HEAD_DIM * self.k.element_size() + 4)

    def default(self, splits: int | None = None, **tiles):
        splits = splits or choose_num_kv_splits(self.bs, NUM_KV_HEADS, torch.cuda.get_device_properties(0)
                                                .multi_processor_count, 16, self.ctx)
        return lambda: decode_attention_fwd(self.q, self.k, self.v, self.out, self.slots, self.reqs, self.seq_lens,
                                            self.part_out, self.part_lse, splits, HEAD_DIM**-0.5, pdl=True, **tiles)

    def mma(self, block_n: int = 16, maxnreg: int | None = None):
        return lambda: decode_fp8_mma_fwd(self.q, self.k, self.v, self.out, self.slots, self.reqs, self.seq_lens,
                                          HEAD_DIM**-0.5, pdl=True, block_n=block_n, maxnreg=maxnreg)

    def variant(self, cfg: dict[str, int]):
        k, v = (self.k.view(torch.int32), self.v.view(torch.int32)) if cfg["cvt"] in (0, 3) else (self.k, self.v)
        block_h = GROUP if cfg["qk"] == 1 else 16
        return lambda: _variant_kernel[(NUM_KV_HEADS, self.bs)](
            self.q, k, v, self.slots, self.out, HEAD_DIM**-0.5, self.q.stride(0), self.q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), self.out.stride(0), self.out.stride(1), CTX=self.ctx, GROUP=GROUP,
            BLOCK_H=block_h, BLOCK_N=cfg["n"], D=HEAD_DIM, WORK=cfg["work"], CVT=cfg["cvt"], QK=cfg["qk"],
            VL=cfg["vl"], PF=cfg["pf"], num_warps=cfg["nw"], num_stages=cfg["ns"], **({"maxnreg": cfg["mr"]} if cfg["mr"] else {}))

    def gather(self):
        words = self.k.view(torch.int32)
        sink = torch.empty(self.bs, NUM_KV_HEADS, HEAD_DIM // 4, dtype=torch.int32, device="cuda")
        return lambda: _gather_kernel[(NUM_KV_HEADS, self.bs)](
            words, self.v.view(torch.int32), self.slots, sink, words.stride(0), words.stride(1), WORDS=HEAD_DIM // 4,
            TWO=True, ROWS=self.ctx, BLOCK_N=32, num_warps=4, num_stages=3)


def tiles_of(spec: str) -> dict:
    a, n, w, s, words, hi = (int(x) for x in spec.split(","))
    return dict(slots_ahead=bool(a), block_n=n, num_warps=w, num_stages=s, words=words, heads_inner=bool(hi))


def _compile(args: tuple) -> None:
    """Compiles some variants by one launch each on a small pool (fills Triton's on-disk cache)."""
    variants, tiles, ctx = args
    pool = Pool(torch.float8_e4m3fn, 4, ctx)
    calls = [pool.variant(parse_variant(spec)) for spec in variants]
    calls += [pool.default(splits, **tiles_of(spec)) for spec in tiles for splits in (1, 2)] + [pool.default(4)]
    for call in calls:
        try:
            call()
        except Exception:  # noqa: BLE001 - the timed run reports it, naming the variant
            pass
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=DEFAULT_VARIANTS, help="stand-alone stage-1 variants (see above)")
    parser.add_argument("--bs", type=int, default=1024)
    parser.add_argument("--ctx", type=int, default=1536)
    parser.add_argument("--tiles", nargs="*", default=DEFAULT_TILES, metavar="A,N,W,S,WORDS,HI",
                        help="decode_attention_fwd's kernel with these tiles, one split")
    parser.add_argument("--mma", nargs="*", default=["16,128", "32,0"], metavar="N,R",
                        help="decode_fp8_mma_fwd with N keys a block and a register cap R (0: none)")
    parser.add_argument("--peak", type=float, default=4290.0, help="GB/s the fractions are of")
    parser.add_argument("--procs", type=int, default=12, help="processes compiling the variants first")
    args = parser.parse_args()
    cfgs = [parse_variant(s) for s in args.variants]
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
          f"UTC; batch {args.bs} x {args.ctx} tokens, {NUM_HEADS} heads on {NUM_KV_HEADS} KV heads, head dim {HEAD_DIM}; "
          f"fractions of {args.peak:.0f} GB/s", flush=True)
    procs = max(1, min(args.procs, len(args.variants) + len(args.tiles)))
    jobs = [(args.variants[i::procs], args.tiles[i::procs], args.ctx) for i in range(procs)]
    with multiprocessing.get_context("spawn").Pool(procs) as workers:
        list(workers.imap_unordered(_compile, jobs))
    print(f"# compiled {len(args.variants)} variants and {len(args.tiles)} tiles", flush=True)

    def report(name: str, pool: Pool, fn, check: bool = False) -> None:
        try:
            fn()
            torch.cuda.synchronize()
            diff = ""
            if check:
                diff = f"  max|diff| {float((pool.out.float() - expected).abs().max()):.2g}"
            ms = median_ms(fn)
        except Exception as exc:  # one variant failing to compile or run must not end the run
            print(f"{name:<40} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        gbs = pool.bytes / (ms * 1e-3) / 1e9
        print(f"{name:<40} {ms * 1e3:8.1f} us {gbs:6.0f} GB/s {gbs / args.peak:5.2f} of peak  "
              f"bound {pool.bytes / args.peak / 1e3:7.1f} us{diff}", flush=True)

    fp8 = Pool(torch.float8_e4m3fn, args.bs, args.ctx)
    fp8.default()()
    expected = fp8.out.float().clone()
    report("fp8 default", fp8, fp8.default())
    report("gather (reads only)", fp8, fp8.gather())
    for spec in args.mma:
        block_n, maxnreg = (int(x) for x in spec.split(","))
        report(f"fp8 mma block_n={block_n} maxnreg={maxnreg}", fp8, fp8.mma(block_n, maxnreg), check=True)
    for splits in (2, 4):
        report(f"fp8 default tiles splits={splits}", fp8, fp8.default(splits), check=True)
    for spec in args.tiles:
        report(f"fp8 tiles {spec}", fp8, fp8.default(1, **tiles_of(spec)), check=True)
    for spec, cfg in zip(args.variants, cfgs, strict=True):
        report("variant " + spec, fp8, fp8.variant(cfg), check=cfg["work"] == 2)
    del fp8
    torch.cuda.empty_cache()
    bf16 = Pool(torch.bfloat16, args.bs, args.ctx)
    report("bf16 default", bf16, bf16.default())


if __name__ == "__main__":
    sys.exit(main())
