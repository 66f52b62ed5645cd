"""SGMV shrink + expand against the torch_native backend and the base layer's own matmul.

Llama-3-8B's LoRA-wrapped projections (hidden 4096, 8 KV heads of 128, MLP 14336):
qkv (3 slices), o, gate_up (2 slices), down. Scenarios: decode at batch 1 (one adapter), decode
with 64 one-token segments over 8 distinct slots, prefill of one 128-token prompt, prefill with 4
segments of 512 tokens. Every timing is a CUDA graph of ``--reps`` calls replayed (the engine
captures decode the same way), so launch overhead counts as it does in a captured step. Prints
microseconds per call, the bytes each LoRA call must move over the time (GB/s), the LoRA share
of the layer (shrink + expand over the base bf16 matmul ``x @ W.T``), and ``eager us``: the
wall time per call of the same calls launched one by one from Python (what an uncaptured
prefill pays, launch overhead included).

    python3 plugins/lora-triton/benchmarks/bench_sgmv.py [--rank 16] [--reps 50] [--sweep FILE.json]
        [--result-file F.jsonl] [--scenarios decode-1 decode-64x8 prefill-1x128 prefill-4x512]
        [--without-pdl] [--old] [--slot-forms] [--breakdown] [--fold]

``--fold`` also times the folded shrink per layer: the base GEMM over ``[W; A_0; ...]`` (the
slots' A as extra output rows) against ``W`` alone, the folded expand alone, and their sum
against the base GEMM plus shrink + expand (``lora-triton.fold_max_rows``).

``--without-pdl`` also times the same kernels launched without programmatic dependent launch;
``--old`` without the split prefill shrink; ``--slot-forms`` decode batches with the per-slot
shrink and the dense expand; ``--breakdown`` each kernel alone.

``--result-file`` appends, per scenario, the four projections' shrink + expand time (the torch_native
backend as its peer) and the base matmuls' time, as rows of the benchmarks page's ``lora`` area.

``--sweep`` also times shrink and expand alone over a grid of block sizes and warps per scenario
and layer (the numbers behind ``shrink_config``/``expand_config``), prints the heuristic's time
beside the best, and writes every timing to FILE.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from engine_lora_torch_native.backend import TorchNativeLoraBackend
from engine_lora_triton.backend import TritonLoraBackend
from engine_lora_triton.fold import sgmv_expand_folded
from engine_lora_triton.launch import (
    expand_config,
    has_pdl,
    sgmv_expand,
    sgmv_shrink,
    sgmv_shrink_slots,
    shrink_config,
    slot_shrink_config,
    sm_count,
)

from engine.bench.results import append_rows
from engine.lora.backend import (
    LoraBatchInfo,
    lora_apply,
    reference_expand,
    reference_fold_expand,
    reference_shrink,
)

HIDDEN, KV, MLP = 4096, 1024, 14336
#: layer -> (K, slice widths of the output)
LAYERS = {"qkv": (HIDDEN, (HIDDEN, KV, KV)), "o": (HIDDEN, (HIDDEN,)),
          "gate_up": (HIDDEN, (MLP, MLP)), "down": (MLP, (HIDDEN,))}
#: scenario -> (segment lengths, distinct adapter slots cycled over the segments)
SCENARIOS = {"decode-1": ([1], 1), "decode-64x8": ([1] * 64, 8), "prefill-1x128": ([128], 1),
             "prefill-4x512": ([512] * 4, 4)}
#: how a result row names each scenario
SCENARIO_WORDS = {"decode-1": "decode batch 1 (one adapter)", "decode-64x8": "decode batch 64 (8 adapters)",
                  "prefill-1x128": "prefill 1 x 128 tokens (one adapter)",
                  "prefill-4x512": "prefill 4 x 512 tokens (4 adapters)"}
SLOTS = 9  # --max-loras-per-batch 8 plus one rank-0 slot (the base model)
DEVICE = "cuda"


def graph_time_us(fn: Callable[[], object], reps: int) -> float:
    """Microseconds per call of ``fn``, from a CUDA graph of ``reps`` calls replayed five times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * reps)


def eager_time_us(fn: Callable[[], object], reps: int) -> float:
    """Wall microseconds per call of ``fn`` launched ``reps`` times from Python, then synchronised."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / reps


#: candidate configs: (BLOCK_R, BLOCK_K, warps) one token a program; (BLOCK_T, BLOCK_R, BLOCK_K, warps,
#: stages) with tl.dot; (BLOCK_N, warps) one token a program; (BLOCK_T, BLOCK_N, warps) with tl.dot;
#: (BLOCK_N, warps) per-slot expand.
SHRINK_GEMV = [(1, 4096, 4), (1, 8192, 8), (2, 4096, 8), (4, 1024, 4), (8, 512, 4), (16, 256, 4)]
SHRINK_DOT = [(16, 64, 64, 4, 3), (32, 64, 64, 4, 3), (64, 64, 64, 4, 3), (32, 64, 128, 4, 4), (64, 32, 128, 4, 3)]
EXPAND_GEMV = [(32, 2), (32, 4), (64, 4), (128, 4)]
EXPAND_DOT = [(16, 64, 4), (32, 64, 4), (64, 64, 4), (64, 128, 4)]
EXPAND_SLOTS = [(32, 4), (64, 4), (64, 8), (128, 8)]


def shrink_candidates(info: LoraBatchInfo) -> list[dict[str, int]]:
    """The sweep's shrink configs for a scenario's form."""
    if info.max_seg_len <= 1:
        return [dict(BLOCK_T=1, BLOCK_R=r, BLOCK_K=kk, num_warps=w, num_stages=2) for r, kk, w in SHRINK_GEMV]
    return [dict(BLOCK_T=t, BLOCK_R=r, BLOCK_K=kk, num_warps=w, num_stages=st) for t, r, kk, w, st in SHRINK_DOT]


def expand_candidates(info: LoraBatchInfo, rank: int) -> list[dict[str, int]]:
    """The sweep's expand configs for a scenario's form."""
    block_r = max(16, triton_pow2(rank))
    if info.max_seg_len <= 1 and info.num_segments >= 16:
        return [dict(SLOTS=1, BLOCK_T=1, BLOCK_N=n, BLOCK_R=block_r, num_warps=w, num_stages=1)
                for n, w in EXPAND_SLOTS]
    if info.max_seg_len <= 1:
        return [dict(BLOCK_T=1, BLOCK_N=n, BLOCK_R=triton_pow2(rank), num_warps=w, num_stages=1)
                for n, w in EXPAND_GEMV]
    return [dict(BLOCK_T=t, BLOCK_N=n, BLOCK_R=block_r, num_warps=w, num_stages=1) for t, n, w in EXPAND_DOT]


def sweep(scen: str, layer: str, info: LoraBatchInfo, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
          out: torch.Tensor, offsets: list[int], rank: int, reps: int,
          ops: tuple[str, ...] = ("shrink", "expand")) -> list[dict[str, Any]]:
    """Shrink and/or expand (``ops``) timed alone, with the heuristic's config and every candidate."""
    rows, k = a.shape[1], a.shape[2]
    width, sms = offsets[-1] - offsets[0], sm_count(x.device)
    args = (info.seg_indptr, info.weight_indices, info.lora_ranks)
    pdl = has_pdl(x.device) and info.max_seg_len <= 1
    shrink_cfgs = shrink_candidates(info)
    expand_cfgs = expand_candidates(info, rank)
    y = sgmv_shrink(x, a, *args, info.num_segments, info.max_seg_len)
    rows_out: list[dict[str, Any]] = []
    for op, default, cfgs in (("shrink", shrink_config(info.num_segments, info.max_seg_len, rows, k, sms), shrink_cfgs),
                              ("expand", expand_config(info.num_segments, info.max_seg_len, width, rank, sms),
                               expand_cfgs)):
        if op not in ops:
            continue
        timed = []
        for cfg in [default] + cfgs:
            if op == "shrink":
                fn = functools.partial(sgmv_shrink, x, a, *args, info.num_segments, info.max_seg_len, pdl, cfg)
            else:
                fn = functools.partial(sgmv_expand, y, b, out, *args, info.scalings, info.num_segments,
                                       info.max_seg_len, offsets, pdl, cfg)
            timed.append((graph_time_us(fn, reps), cfg))
        best = min(timed[1:], key=lambda tc: tc[0])
        print(f"sweep {scen:<14} {layer:<8} {op:<6} heuristic {timed[0][0]:7.1f} us {timed[0][1]}  "
              f"best {best[0]:7.1f} us {best[1]}; all: {' '.join(f'{t:.1f}' for t, _ in timed[1:])}", flush=True)
        rows_out += [dict(scenario=scen, layer=layer, op=op, us=t, heuristic=i == 0, **c)
                     for i, (t, c) in enumerate(timed)]
    if info.max_seg_len <= 1 and info.num_segments >= 16 and {"slot_shrink", "slot_expand"} & set(ops):
        rows_out += sweep_slots(scen, layer, info, x, a, b, out, offsets, rank, reps, ops)
    return rows_out


#: per-slot shrink (K_CHUNK, BLOCK_K, warps, stages); expand of its partial sums (BLOCK_N, warps,
#: column tiles a program).
SLOT_SHRINK = [(128, 64, 4, 2), (256, 64, 4, 2), (256, 128, 4, 2), (512, 64, 4, 2), (512, 128, 4, 3),
               (1024, 128, 4, 3), (1024, 128, 8, 3)]
SLOT_EXPAND = [(64, 4, 1), (64, 4, 2), (64, 4, 4), (64, 4, 8), (64, 4, 16), (128, 4, 2), (128, 4, 8), (128, 8, 8)]


def sweep_slots(scen: str, layer: str, info: LoraBatchInfo, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                out: torch.Tensor, offsets: list[int], rank: int, reps: int, ops: tuple[str, ...]) -> list[dict[str, Any]]:
    """The per-slot shrink (and the expand of its partials) over block sizes, each candidate's
    partial sums checked against the heuristic's first."""
    args = (info.seg_indptr, info.weight_indices, info.lora_ranks)
    pdl = has_pdl(x.device)
    default = slot_shrink_config(a.shape[0], a.shape[1], a.shape[2], sm_count(x.device))
    want = sgmv_shrink_slots(x, a, *args, info.num_segments, pdl).sum(0)
    rows_out: list[dict[str, Any]] = []
    if "slot_shrink" in ops:
        timed = []
        for cfg in [default] + [dict(BLOCK_R=16, BLOCK_K=bk, K_CHUNK=ch, num_warps=w, num_stages=st)
                                for ch, bk, w, st in SLOT_SHRINK if ch <= triton_pow2(a.shape[2])]:
            got = sgmv_shrink_slots(x, a, *args, info.num_segments, pdl, cfg).sum(0)
            used = info.weight_indices.long()
            live = info.lora_ranks[used] > 0
            assert torch.allclose(got[:info.num_segments][live], want[:info.num_segments][live], rtol=1e-2, atol=1e-2), cfg
            timed.append((graph_time_us(functools.partial(sgmv_shrink_slots, x, a, *args, info.num_segments, pdl, cfg),
                                        reps), cfg))
        best = min(timed[1:], key=lambda tc: tc[0])
        print(f"sweep {scen:<14} {layer:<8} slot shrink heuristic {timed[0][0]:6.1f} us {timed[0][1]}  best "
              f"{best[0]:6.1f} us {best[1]}; all: {' '.join(f'{t:.1f}' for t, _ in timed[1:])}", flush=True)
        rows_out += [dict(scenario=scen, layer=layer, op="slot_shrink", us=t, heuristic=i == 0, **c)
                     for i, (t, c) in enumerate(timed)]
    if "slot_expand" in ops:
        p = sgmv_shrink_slots(x, a, *args, info.num_segments, pdl)
        timed = []
        block_r = max(16, triton_pow2(rank))
        for cfg in [None] + [dict(SLOTS=1, BLOCK_T=1, BLOCK_N=n, BLOCK_R=block_r, TILES=g, num_warps=w, num_stages=1)
                             for n, w, g in SLOT_EXPAND]:
            fn = functools.partial(sgmv_expand, p, b, out, *args, info.scalings, info.num_segments, info.max_seg_len,
                                   offsets, pdl, cfg)
            timed.append((graph_time_us(fn, reps), cfg))
        best = min(timed[1:], key=lambda tc: tc[0])
        print(f"sweep {scen:<14} {layer:<8} expand of {p.shape[0]} partials heuristic {timed[0][0]:6.1f} us  best "
              f"{best[0]:6.1f} us {best[1]}; all: {' '.join(f'{t:.1f}' for t, _ in timed[1:])}", flush=True)
        rows_out += [dict(scenario=scen, layer=layer, op="slot_expand", us=t, heuristic=i == 0, **(c or {}))
                     for i, (t, c) in enumerate(timed)]
    return rows_out


def breakdown(scen: str, layer: str, info: LoraBatchInfo, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              out: torch.Tensor, offsets: list[int], reps: int) -> None:
    """Each kernel alone with its heuristic config: shrink, expand of a finished y, and for decode
    batches of 16+ segments the per-slot shrink and the expand of its partial sums."""
    args = (info.seg_indptr, info.weight_indices, info.lora_ranks)
    pdl = has_pdl(x.device) and info.max_seg_len <= 1
    y = sgmv_shrink(x, a, *args, info.num_segments, info.max_seg_len)
    t = {"shrink": graph_time_us(functools.partial(sgmv_shrink, x, a, *args, info.num_segments,
                                                   info.max_seg_len, pdl), reps),
         "expand": graph_time_us(functools.partial(sgmv_expand, y, b, out, *args, info.scalings, info.num_segments,
                                                   info.max_seg_len, offsets, pdl), reps)}
    if info.max_seg_len <= 1 and info.num_segments >= 16:
        t["dense expand"] = graph_time_us(functools.partial(
            sgmv_expand, y, b, out, *args, info.scalings, info.num_segments, info.max_seg_len, offsets, pdl,
            dense=True), reps)
        p = sgmv_shrink_slots(x, a, *args, info.num_segments, pdl)
        t["slot shrink"] = graph_time_us(functools.partial(sgmv_shrink_slots, x, a, *args, info.num_segments, pdl),
                                         reps)
        for dense in (False, True):
            t[f"{'dense ' if dense else ''}expand of {p.shape[0]} partials"] = graph_time_us(
                functools.partial(sgmv_expand, p, b, out, *args, info.scalings, info.num_segments, info.max_seg_len,
                                  offsets, pdl, dense=dense), reps)
    print(f"alone {scen:<14} {layer:<8} " + "; ".join(f"{k} {v:.1f} us" for k, v in t.items()), flush=True)


def fold_times(scen: str, layer: str, info: LoraBatchInfo, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, offsets: list[int], reps: int, unfolded_us: float) -> dict[str, float]:
    """The folded form of one layer: ``F.linear`` over ``W' = [W; A_0; ...; A_7]`` against ``W``, the
    folded expand alone, and GEMM + expand against ``unfolded_us`` (base GEMM + shrink + expand).
    The output is checked against the torch loop first."""
    # As LoRA layers run it: the last slot (the base model's, rank 0) left out of the GEMM.
    w_fold = torch.cat([w, a[:-1].reshape(-1, a.shape[-1])])
    h = F.linear(x, w_fold)
    pdl = has_pdl(x.device) and info.max_seg_len <= 1
    one = info.max_seg_len <= 1 and info.num_segments == x.shape[0]  # segment t is token t (decode)
    expand = functools.partial(sgmv_expand_folded, h, b, info.seg_indptr, info.weight_indices, info.lora_ranks,
                               info.scalings, info.num_segments, offsets, pdl, one)
    got, want = expand(), reference_fold_expand(h, b, info, offsets)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))
    assert err < 2e-2, f"{scen} {layer} folded expand: relative error {err:.3g}"

    def both() -> torch.Tensor:
        return sgmv_expand_folded(F.linear(x, w_fold), b, info.seg_indptr, info.weight_indices, info.lora_ranks,
                                  info.scalings, info.num_segments, offsets, pdl, one)

    block_r = max(16, triton_pow2(b.shape[2]))
    swept = [(graph_time_us(functools.partial(expand.func, *expand.args, config=dict(
        BLOCK_T=min(64, max(16, triton_pow2(x.shape[0]))), BLOCK_N=bn, BLOCK_R=block_r, num_warps=wp,
        num_stages=1)), reps), bn, wp)
        for bn, wp in ((32, 4), (64, 4), (32, 8), (64, 8))]
    print(f"fold {scen:<14} {layer:<8} folded expand (BLOCK_N, warps): "
          + ", ".join(f"({bn}, {wp}) {us:.1f} us" for us, bn, wp in swept), flush=True)
    # The GEMM's shape variants: with every slot's rows, and padded to a multiple of 256 rows.
    every = torch.cat([w, a.reshape(-1, a.shape[-1])])
    padded = torch.cat([w_fold, w_fold.new_zeros(-w_fold.shape[0] % 256, w_fold.shape[1])])
    shapes = {f"{m.shape[0]} rows": graph_time_us(functools.partial(F.linear, x, m), reps) for m in (every, padded)}
    print(f"fold {scen:<14} {layer:<8} GEMM variants: " + ", ".join(f"{k} {v:.1f} us" for k, v in shapes.items()),
          flush=True)
    t = {"W": graph_time_us(functools.partial(F.linear, x, w), reps),
         "Wf": graph_time_us(functools.partial(F.linear, x, w_fold), reps),
         "expand": graph_time_us(expand, reps), "fold": graph_time_us(both, reps), "unfolded": unfolded_us}
    print(f"fold {scen:<14} {layer:<8} GEMM W {t['W']:6.1f} us, W' (+{w_fold.shape[0] - w.shape[0]} rows) "
          f"{t['Wf']:6.1f} us; folded expand {t['expand']:5.1f} us; W' + expand {t['fold']:6.1f} us against "
          f"W + shrink + expand {unfolded_us:6.1f} us", flush=True)
    return t


def triton_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def build(lens: list[int], distinct: int, rank: int, dev: torch.device) -> LoraBatchInfo:
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    ranks = torch.tensor([rank] * (SLOTS - 1) + [0], dtype=torch.int32)
    return LoraBatchInfo(num_segments=len(lens), seg_indptr=indptr.to(dev),
                         weight_indices=torch.tensor([i % distinct for i in range(len(lens))], dtype=torch.int32,
                                                     device=dev),
                         lora_ranks=ranks.to(dev), scalings=torch.full((SLOTS,), 2.0, device=dev),
                         max_seg_len=max(lens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", metavar="FILE.json", help="also sweep block sizes; write the timings here")
    ap.add_argument("--sweep-ops", nargs="+", choices=("shrink", "expand", "slot_shrink", "slot_expand"),
                    default=["shrink", "expand"],
                    help="which kernels --sweep times (default: both)")
    ap.add_argument("--result-file", default=None, help="append the per-scenario sums as JSON lines")
    ap.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS),
                    help="which scenarios to run (default: all)")
    ap.add_argument("--layers", nargs="+", choices=list(LAYERS), default=list(LAYERS),
                    help="which projections to run (default: all four; sums cover only these)")
    ap.add_argument("--without-pdl", action="store_true", help="also time the kernels launched without PDL")
    ap.add_argument("--old", action="store_true",
                    help="also time the token-parallel decode shrink, per-slot decode expand and whole-K "
                         "prefill shrink (lora-triton.slot_shrink=false, dense_expand=false, split_prefill=false)")
    ap.add_argument("--slot-forms", action="store_true",
                    help="also time decode batches with the per-slot shrink and the dense expand "
                         "(lora-triton.slot_shrink=true, dense_expand=true)")
    ap.add_argument("--fold", action="store_true",
                    help="also time the folded shrink (A rows under the base weight) and its expand per layer")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each kernel alone (shrink, per-slot shrink, expand) per layer")
    args = ap.parse_args()
    swept: list[dict[str, Any]] = []
    dev = torch.device(DEVICE)
    dt = torch.bfloat16
    torch.manual_seed(0)
    triton_be, native_be = TritonLoraBackend(), TorchNativeLoraBackend(per_segment=False)
    # Extra columns: name -> backend.
    extra = {"no-pdl us": TritonLoraBackend(pdl=False)} if args.without_pdl else {}
    if args.old:
        extra["old us"] = TritonLoraBackend(slot_shrink=False, split_prefill=False, dense_expand=False)
    if args.slot_forms:
        extra["slot us"] = TritonLoraBackend(slot_shrink=True, dense_expand=True)
    print(f"# {torch.cuda.get_device_name(dev)}, bf16, rank {args.rank}, {SLOTS} pool slots, "
          f"CUDA graphs of {args.reps} calls")
    print(f"{'scenario':<14} {'layer':<8} {'base us':>8} {'triton us':>9} {'GB/s':>6} {'eager us':>9} "
          + "".join(f"{name:>10}" for name in extra)
          + f" {'native us':>9} {'triton/base':>11} {'native/base':>11}")
    for scen in args.scenarios:
        lens, distinct = SCENARIOS[scen]
        info = build(lens, distinct, args.rank, dev)
        tokens = sum(lens)
        totals: dict[str, float] = {}
        fold_totals: dict[str, float] = {}
        for layer, (k, widths) in LAYERS.items():
            if layer not in args.layers:
                continue
            n = sum(widths)
            offsets = [0]
            for w in widths:
                offsets.append(offsets[-1] + w)
            s = len(widths)
            x = torch.randn(tokens, k, device=dev, dtype=dt)
            w_base = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
            a = torch.randn(SLOTS, s * args.rank, k, device=dev, dtype=dt) / k ** 0.5
            b = torch.randn(SLOTS, n, args.rank, device=dev, dtype=dt) / args.rank ** 0.5
            out = torch.zeros(tokens, n, device=dev, dtype=dt)
            # Correctness on these shapes first, for every timed triton form.
            ref_y = reference_shrink(x, a, info)
            want = out.float()
            reference_expand(ref_y, b, info, want, offsets)
            for be in [triton_be, *extra.values()]:
                y = be.shrink(x, a, info)
                got = out.clone()
                be.expand(ref_y, b, info, got, offsets)
                err_y = float((y.float() - ref_y.float()).abs().max() / ref_y.float().abs().max().clamp_min(1e-6))
                err_o = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))
                both = out.clone()
                lora_apply(be, x, a, b, info, both, offsets)
                err_a = float((both.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))
                assert err_y < 2e-2 and err_o < 2e-2 and err_a < 2e-2, \
                    f"{scen} {layer} {type(be).__name__}: relative error shrink {err_y:.3g}, expand {err_o:.3g}, " \
                    f"apply {err_a:.3g}"
            if args.breakdown:
                breakdown(scen, layer, info, x, a, b, out, offsets, args.reps)

            call = functools.partial(functools.partial, lora_apply)
            tensors = (x, a, b, info, out, offsets)
            t = {"base": graph_time_us(functools.partial(torch.matmul, x, w_base.T), args.reps),
                 "triton": graph_time_us(call(triton_be, *tensors), args.reps),
                 "eager": eager_time_us(call(triton_be, *tensors), args.reps),
                 **{name: graph_time_us(call(be, *tensors), args.reps) for name, be in extra.items()},
                 "native": graph_time_us(call(native_be, *tensors), args.reps)}
            used = min(distinct, len(lens))
            moved = 2 * (tokens * k + used * s * args.rank * k + 2 * tokens * s * args.rank
                         + used * n * args.rank + 2 * tokens * n)
            for key, v in t.items():
                totals[key] = totals.get(key, 0.0) + v
            if args.fold:
                for key, v in fold_times(scen, layer, info, x, w_base, a, b, offsets, args.reps,
                                         t["base"] + t["triton"]).items():
                    fold_totals[key] = fold_totals.get(key, 0.0) + v
            if args.sweep:
                swept += sweep(scen, layer, info, x, a, b, out, offsets, args.rank, args.reps, tuple(args.sweep_ops))
            print(f"{scen:<14} {layer:<8} {t['base']:8.1f} {t['triton']:9.1f} {moved / t['triton'] / 1e3:6.0f} "
                  f"{t['eager']:9.1f} " + "".join(f"{t[name]:10.1f}" for name in extra)
                  + f" {t['native']:9.1f} {t['triton'] / t['base']:11.2f} {t['native'] / t['base']:11.2f}")
        print(f"{scen:<14} {'sum':<8} {totals['base']:8.1f} {totals['triton']:9.1f} {'':>6} {totals['eager']:9.1f} "
              + "".join(f"{totals[name]:10.1f}" for name in extra)
              + f" {totals['native']:9.1f} {totals['triton'] / totals['base']:11.2f} "
              f"{totals['native'] / totals['base']:11.2f}", flush=True)
        if fold_totals:
            print(f"fold {scen:<14} {'sum':<8} GEMM W {fold_totals['W']:6.1f} us, W' {fold_totals['Wf']:6.1f} us; "
                  f"folded expand {fold_totals['expand']:5.1f} us; W' + expand {fold_totals['fold']:6.1f} us against "
                  f"W + shrink + expand {fold_totals['unfolded']:6.1f} us", flush=True)
        what = f"Llama-3-8B {', '.join(args.layers)} of one layer, {SCENARIO_WORDS[scen]}"
        device = torch.cuda.get_device_name(dev)
        append_rows(args.result_file,
                    {"area": "lora", "bench": "kernel", "device": device, "us": round(totals["triton"], 2),
                     "config": f"LoRA shrink + expand (triton), rank {args.rank}, bf16, {what}",
                     "peer": {"config": "torch_native backend, same run", "us": round(totals["native"], 2)}},
                    {"area": "lora", "bench": "kernel", "device": device, "us": round(totals["base"], 2),
                     "config": f"base layers' bf16 matmuls (no LoRA), {what}"})
        if fold_totals:
            append_rows(args.result_file,
                        {"area": "lora", "bench": "kernel", "device": device, "us": round(fold_totals["fold"], 2),
                         "config": f"base layers with the folded shrink: bf16 GEMM over [W; A of {SLOTS - 1} slots] + "
                                   f"folded expand (triton), rank {args.rank}, {what}",
                         "peer": {"config": "base bf16 matmuls + shrink + expand, same run",
                                  "us": round(fold_totals["unfolded"], 2)}})
    if args.sweep:
        with open(args.sweep, "w") as f:
            json.dump(swept, f, indent=0)


if __name__ == "__main__":
    main()
