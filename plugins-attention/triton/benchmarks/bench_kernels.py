"""Times the Triton decode and extend kernels at Llama-3-8B attention shapes on the current GPU.

Run from the repository root:

    PYTHONPATH=core/src:plugins-attention/triton/src \
        python3 plugins-attention/triton/benchmarks/bench_kernels.py [--sweep]

Decode is memory-bound: it reports the bytes it must move (K and V of every cached
token once, plus the int32 slot indices) over the median time, beside the bandwidth
of a large device-to-device copy measured on the same GPU (bytes read + written).
Extend is mostly compute-bound: it reports causal TFLOP/s (the useful half of the
score matrix only) and, where there is no prefix, torch's SDPA as a yardstick.
Times are medians of ``triton.testing.do_bench``, which clears L2 before each run;
decode is also timed inside a CUDA graph (no launch gaps, as when serving), over
copies of the inputs larger than L2 together.
``--sweep`` also times split counts and tile shapes, to tune the defaults.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from unittest import mock

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import engine_attention_triton.extend_attention as extend_module
from engine_attention_triton.decode_attention import choose_num_kv_splits, decode_attention_fwd
from engine_attention_triton.extend_attention import default_extend_config, extend_attention_fwd, gather_widened

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
DTYPE = torch.bfloat16
DEV = "cuda"


def median_ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB: bytes read plus written over time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def paged_rows(seq_lens: list[int]) -> tuple[torch.Tensor, ...]:
    """A page-size-1 pool, each row's slots shuffled: (k, v, req_to_token, req indices)."""
    total = sum(seq_lens)
    k = torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    v = torch.randn_like(k)
    req_to_token = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int32, device=DEV)
    perm = (torch.randperm(total, device=DEV) + 1).to(torch.int32)
    cursor = 0
    for row, n in enumerate(seq_lens):
        req_to_token[row, :n] = perm[cursor : cursor + n]
        cursor += n
    return k, v, req_to_token, torch.arange(len(seq_lens), device=DEV)


def graph_ms(calls: list) -> float:
    """Median time of one call when ``calls`` run back to back inside one CUDA graph.

    Removes launch overhead, as in serving (decode runs under CUDA graphs); the calls
    use distinct inputs, together larger than L2, so the data comes from HBM.
    """
    for call in calls:  # compile outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_ms(graph.replay) / len(calls)


def bench_decode(bs: int, ctx: int, num_sms: int, sweep: bool) -> list[str]:
    kv_bytes = bs * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * 2 + bs * ctx * 4
    copies = max(1, -(-(160 << 20) // kv_bytes))  # >= 160 MB in all, over 3x the 50 MB L2
    inputs = []
    for _ in range(copies):
        k, v, req_to_token, reqs = paged_rows([ctx] * bs)
        q = torch.randn(bs, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        inputs.append((q, k, v, torch.empty_like(q), req_to_token, reqs))
    seq_lens = torch.full((bs,), ctx, dtype=torch.int64, device=DEV)
    part_out = torch.empty(bs, NUM_HEADS, 64, HEAD_DIM, dtype=torch.float32, device=DEV)
    part_lse = torch.empty(bs, NUM_HEADS, 64, dtype=torch.float32, device=DEV)
    default = choose_num_kv_splits(bs, NUM_KV_HEADS, num_sms, 16, ctx)

    def call(i: int, splits: int, tiles: dict[str, int]):
        q, k, v, out, req_to_token, reqs = inputs[i]
        return lambda: decode_attention_fwd(q, k, v, out, req_to_token, reqs, seq_lens, part_out,
                                            part_lse, splits, HEAD_DIM**-0.5, **tiles)

    variants = [("default", default, {})]
    if sweep:
        variants += [(f"splits={s}", s, {}) for s in (1, 2, 4, 8, 16, 32) if s != default]
        variants += [(f"block_n={b}", default, {"block_n": b}) for b in (32, 128)]
        variants += [("stages=2", default, {"num_stages": 2}),
                     ("stages=4", default, {"num_stages": 4})]
    lines = []
    for name, splits, tiles in variants:
        eager = median_ms(call(0, splits, tiles))
        graph = graph_ms([call(i, splits, tiles) for i in range(copies)])
        lines.append(
            f"decode bs={bs:<3} ctx={ctx:<5} {name:<12} splits={splits:<3} eager "
            f"{eager * 1e3:7.1f} us {kv_bytes / (eager * 1e-3) / 1e9:5.0f} GB/s | graph "
            f"{graph * 1e3:7.1f} us {kv_bytes / (graph * 1e-3) / 1e9:5.0f} GB/s"
        )
    return lines


def bench_extend(bs: int, prefix: int, ext: int, sweep: bool) -> list[str]:
    k_pool, v_pool, req_to_token, reqs = paged_rows([prefix + ext] * bs)
    tokens = bs * ext
    q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    v = torch.randn_like(k)
    out = torch.empty_like(q)

    def dev(x: int) -> torch.Tensor:
        return torch.full((bs,), x, dtype=torch.int64, device=DEV)

    starts = torch.arange(bs, device=DEV) * ext
    flops = 4 * NUM_HEADS * HEAD_DIM * bs * (ext * prefix + ext * (ext + 1) / 2)
    configs = [default_extend_config(HEAD_DIM, DTYPE, ext)]
    if sweep:
        configs += [(64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 4),
                    (64, 32, 4, 3), (128, 64, 4, 2)]
    lines = []
    for config in configs:
        ms = median_ms(lambda: extend_attention_fwd(
            q, k, v, out, k_pool, v_pool, req_to_token, reqs, dev(prefix), dev(ext), starts,
            ext, HEAD_DIM**-0.5, config=config))
        lines.append(f"extend bs={bs:<3} prefix={prefix:<5} ext={ext:<5} cfg={config!s:<18} "
                     f"{ms * 1e3:9.1f} us  {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s")
    if prefix == 0:
        qs = q.view(bs, ext, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        ks = k.view(bs, ext, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        vs = v.view(bs, ext, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        ms = median_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                              enable_gqa=True))
        lines.append(f"extend bs={bs:<3} prefix={prefix:<5} ext={ext:<5} {'torch SDPA':<22} "
                     f"{ms * 1e3:9.1f} us  {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s")
    return lines


#: Extend tiles --extend-fp8 also times on the bf16 K/V: (BLOCK_M, BLOCK_N, warps, stages).
EXTEND_CONFIGS = ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 32, 4, 3))


def bench_extend_fp8(bs: int, ext: int) -> list[str]:
    """A prefill chunk over an e4m3 pool without prefix: the new tokens' K/V as the backend passes
    them (gathered back from the pool, e4m3) widened inside the kernel (``WIDEN_NEW_KV_FIRST``
    switched off for that row) against the same values widened to bf16 first (exact), with that
    widening's own time; all at the default tiles, then the bf16 K/V at ``EXTEND_CONFIGS``. First the
    bf16 K/V in the plain launch order and with the last query blocks first (``HEAVY_BLOCKS_FIRST``),
    and the new tokens' read-back from the e4m3 pool: gather and cast in torch ops against
    ``gather_widened``."""
    tokens = bs * ext
    q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    k8 = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, device=DEV).to(torch.float8_e4m3fn)
    v8 = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, device=DEV).to(torch.float8_e4m3fn)
    k_pool, v_pool, req_to_token, reqs = paged_rows([ext] * bs)
    k_pool8, v_pool8 = k_pool.to(k8.dtype), v_pool.to(k8.dtype)
    out = torch.empty_like(q)
    lens = torch.full((bs,), ext, dtype=torch.int64, device=DEV)
    zeros = torch.zeros_like(lens)
    starts = torch.arange(bs, device=DEV) * ext
    flops = 4 * NUM_HEADS * HEAD_DIM * bs * ext * (ext + 1) / 2
    kb, vb = k8.to(DTYPE), v8.to(DTYPE)

    def widened_inside() -> None:
        with mock.patch.object(extend_module, "WIDEN_NEW_KV_FIRST", False):
            extend_attention_fwd(q, k8, v8, out, k_pool8, v_pool8, req_to_token, reqs, zeros, lens, starts, ext,
                                 HEAD_DIM**-0.5)

    def plain_order() -> None:
        with mock.patch.object(extend_module, "HEAVY_BLOCKS_FIRST", False):
            extend_attention_fwd(q, kb, vb, out, k_pool, v_pool, req_to_token, reqs, zeros, lens, starts, ext,
                                 HEAD_DIM**-0.5)

    loc = req_to_token[:, :ext].reshape(-1).long()  # the new tokens' slots, as out_cache_loc
    lines = []
    for name, fn in (
        ("bf16 k/v plain block order", plain_order),
        ("bf16 k/v heavy blocks first", lambda: extend_attention_fwd(q, kb, vb, out, k_pool, v_pool, req_to_token,
                                                                     reqs, zeros, lens, starts, ext, HEAD_DIM**-0.5)),
        ("gather + widen (torch ops)", lambda: (k_pool8[loc].to(DTYPE), v_pool8[loc].to(DTYPE))),
        ("gather_widened (one launch)", lambda: gather_widened(k_pool8, v_pool8, loc, DTYPE)),
        ("e4m3 k/v (in the kernel)", widened_inside),
        ("bf16 k/v (widened first)", lambda: extend_attention_fwd(q, k8.to(DTYPE), v8.to(DTYPE), out, k_pool, v_pool,
                                                                  req_to_token, reqs, zeros, lens, starts, ext,
                                                                  HEAD_DIM**-0.5)),
        ("the widening alone", lambda: (k8.to(DTYPE), v8.to(DTYPE))),
        *((f"bf16 k/v cfg {cfg}", lambda cfg=cfg: extend_attention_fwd(
            q, kb, vb, out, k_pool, v_pool, req_to_token, reqs, zeros, lens, starts, ext, HEAD_DIM**-0.5, config=cfg))
          for cfg in EXTEND_CONFIGS),
    ):
        ms = median_ms(fn)
        lines.append(f"extend-fp8 bs={bs:<3} ext={ext:<5} {name:<26} {ms * 1e3:9.1f} us  "
                     f"{flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time split counts and tiles")
    parser.add_argument("--extend-fp8", action="store_true",
                        help="only a prefill chunk (8 x 1,024 tokens) over an e4m3 pool: k/v widened in the kernel or first")
    args = parser.parse_args()
    if args.extend_fp8:
        print("\n".join(bench_extend_fp8(8, 1024)), flush=True)
        return
    props = torch.cuda.get_device_properties(0)
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}, {now:%Y-%m-%d %H:%M} UTC")
    print(f"# device-to-device copy: {copy_bandwidth_gbs():.0f} GB/s (read + write)")
    print(f"# heads q/kv/dim = {NUM_HEADS}/{NUM_KV_HEADS}/{HEAD_DIM}, {DTYPE}")
    for bs in (1, 64):
        for ctx in (1024, 4096):
            print("\n".join(bench_decode(bs, ctx, props.multi_processor_count, args.sweep)),
                  flush=True)
    for bs, prefix, ext in ((1, 0, 4096), (4, 3072, 1024), (16, 0, 512)):
        print("\n".join(bench_extend(bs, prefix, ext, args.sweep)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
