"""The Triton kernels and backend against the float64 torch reference on random paged batches.

Every test draws a fresh seed (printed on failure), fills the whole pool and the
unused part of ``req_to_token`` with random data (a stray read changes the result),
shuffles KV pages, and poisons outputs and workspaces with NaN before the kernels run
(an unwritten element fails the check).

Tolerances, against the reference computed in float64 from the same rounded inputs:
max |err| <= 2e-2 and ||err|| / ||ref|| <= 1e-2 for bf16; 5e-3 and 3e-3 for fp16;
1e-4 and 1e-5 for fp32 (IEEE products, no tf32).
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("triton", reason="the triton backend needs the triton package")

from engine.attention import AttentionContext, AttentionLayerInfo  # noqa: E402
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from engine.model_executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from engine_attention_triton import decode_attention  # noqa: E402
from engine_attention_triton.backend import create  # noqa: E402
from engine_attention_triton.decode_attention import decode_attention_fwd, has_pdl  # noqa: E402
from engine_attention_triton.extend_attention import extend_attention_fwd  # noqa: E402
from engine_attention_triton.reference import reference_decode, reference_extend  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOLERANCE = {BF16: (2e-2, 1e-2), FP16: (5e-3, 3e-3), FP32: (1e-4, 1e-5)}
DEV = "cuda"


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten or bad math)"
    err = (out.double() - ref.double()).abs()
    max_abs = err.max().item()
    rel = (err.norm() / ref.double().norm().clamp_min(1e-30)).item()
    atol, rtol = TOLERANCE[dtype]
    assert max_abs <= atol and rel <= rtol, (
        f"{what}: max abs err {max_abs:.3g} (limit {atol}), rel L2 err {rel:.3g} (limit {rtol})"
    )


def random_lens(n: int, low: int, high: int) -> list[int]:
    """``n`` lengths in ``[low, high]`` that include both ends when n allows."""
    lens = [random.randint(low, high) for _ in range(n)]
    if n >= 2:
        lens[0], lens[-1] = high, low
    random.shuffle(lens)
    return lens


class PagedPools:
    """A pool holding rows of the given lengths on shuffled pages, everything else random."""

    def __init__(self, seq_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, spare_pages: int = 7) -> None:
        ps = page_size
        pages_per_row = [-(-s // ps) for s in seq_lens]
        num_pages = sum(pages_per_row) + spare_pages
        self.kv = MHATokenToKVPool(num_pages * ps, ps, dtype, num_kv_heads, head_dim, 1, DEV)
        self.k_buffer, self.v_buffer = self.kv.get_kv_buffer(0)
        self.k_buffer.normal_()
        self.v_buffer.normal_()
        self.req = ReqToTokenPool(len(seq_lens) + 5, max(seq_lens, default=1) + 33, DEV)
        self.req.req_to_token.random_(0, self.k_buffer.shape[0])
        # Page 0 is the padding page; rows get the others in random order.
        pages = torch.randperm(num_pages, device=DEV) + 1
        self.req_slots = torch.randperm(self.req.size)[: len(seq_lens)].tolist()
        self.row_slots: list[torch.Tensor] = []
        cursor = 0
        offsets = torch.arange(ps, device=DEV)
        for slot, seq_len, n in zip(self.req_slots, seq_lens, pages_per_row):
            row_pages = pages[cursor : cursor + n]
            cursor += n
            slots = (row_pages[:, None] * ps + offsets[None, :]).reshape(-1)[:seq_len]
            self.req.req_to_token[slot, :seq_len] = slots.to(torch.int32)
            self.row_slots.append(slots)

    def indices(self) -> torch.Tensor:
        return torch.tensor(self.req_slots, dtype=torch.int64, device=DEV)

    def context(self, num_heads: int, dtype: torch.dtype, **options: int) -> AttentionContext:
        return AttentionContext(
            device=torch.device(DEV), dtype=dtype, num_layers=1, num_heads=num_heads,
            num_kv_heads=self.kv.num_kv_heads, head_dim=self.kv.head_dim,
            page_size=self.kv.page_size, max_context_len=self.req.max_context_len,
            req_to_token_pool=self.req, token_to_kv_pool=self.kv, options=dict(options),
        )


# id, dtype, group, kv heads, head_dim, page size, batch, max len, logit cap, window, splits
DECODE_CASES = [
    ("bf16-mha-bs1", BF16, 1, 4, 128, 1, 1, 2000, 0.0, -1, 8),
    ("bf16-g4-ps16-bs64", BF16, 4, 2, 128, 16, 64, 2000, 0.0, -1, 4),
    ("bf16-g8-ps16-1split", BF16, 8, 2, 128, 16, 7, 1500, 0.0, -1, 1),
    ("fp16-g8-d64-bs33", FP16, 8, 2, 64, 1, 33, 700, 0.0, -1, 16),
    ("fp16-g4-d64-ps16-4k", FP16, 4, 2, 64, 16, 1, 4000, 0.0, -1, 32),
    ("bf16-g8-kv8-cap", BF16, 8, 8, 128, 16, 12, 1200, 20.0, -1, 8),
    ("fp16-g4-window", FP16, 4, 2, 128, 1, 16, 1500, 0.0, 100, 8),
    ("bf16-g4-window0-cap", BF16, 4, 2, 128, 16, 9, 600, 30.0, 0, 3),
    ("fp32-g4", FP32, 4, 2, 128, 16, 8, 1000, 0.0, -1, 4),
    ("bf16-g6-d96-window", BF16, 6, 2, 96, 16, 5, 900, 0.0, 300, 5),
    # One split: stage 1 writes the output itself and the merge pass is skipped.
    ("fp16-g4-window-1split", FP16, 4, 2, 128, 1, 16, 1500, 0.0, 100, 1),
    ("bf16-mha-cap-1split", BF16, 1, 4, 128, 1, 5, 800, 20.0, -1, 1),
    ("fp32-g4-d96-1split", FP32, 4, 2, 96, 16, 9, 700, 0.0, -1, 1),
]


@pytest.mark.parametrize(
    "dtype,group,kv_heads,head_dim,page_size,bs,max_len,cap,window,splits",
    [c[1:] for c in DECODE_CASES], ids=[c[0] for c in DECODE_CASES],
)
def test_decode_kernel_matches_reference(
    seed: int, dtype: torch.dtype, group: int, kv_heads: int, head_dim: int, page_size: int,
    bs: int, max_len: int, cap: float, window: int, splits: int,
) -> None:
    seq_lens = random_lens(bs, 1, max_len)
    pools = PagedPools(seq_lens, page_size, kv_heads, head_dim, dtype)
    num_heads = group * kv_heads
    q_scale = 8.0 if cap > 0 else 1.0  # push scores into the cap's saturating range
    q = torch.randn(bs, num_heads, head_dim, dtype=dtype, device=DEV) * q_scale
    out = torch.full((bs, num_heads, head_dim), float("nan"), dtype=dtype, device=DEV)
    # One spare split in the workspace: the kernels must use its strides, not its shape.
    part_out = torch.full((bs, num_heads, splits + 1, head_dim), float("nan"), device=DEV)
    part_lse = torch.full((bs, num_heads, splits + 1), float("nan"), device=DEV)
    seq_lens_dev = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = head_dim**-0.5
    decode_attention_fwd(
        q, pools.k_buffer, pools.v_buffer, out, pools.req.req_to_token, pools.indices(),
        seq_lens_dev, part_out, part_lse, splits, scale, cap, window,
    )
    ref = reference_decode(q, pools.k_buffer, pools.v_buffer, pools.req.req_to_token,
                           pools.req_slots, seq_lens, scale, cap, window)
    assert_matches(out, ref, dtype, f"decode seed={seed} lens={seq_lens[:8]}")


# id, dtype, group, kv heads, head_dim, page size, batch, max prefix, max extend, cap, window
EXTEND_CASES = [
    ("bf16-mha-bs1-noprefix", BF16, 1, 4, 128, 1, 1, 0, 1000, 0.0, -1),
    ("bf16-g4-ps16-bs8", BF16, 4, 2, 128, 16, 8, 2000, 300, 0.0, -1),
    ("fp16-g8-d64-ps16-bs64", FP16, 8, 2, 64, 16, 64, 500, 64, 0.0, -1),
    ("bf16-g8-cap", BF16, 8, 2, 128, 1, 6, 800, 200, 20.0, -1),
    ("fp16-g4-window", FP16, 4, 2, 128, 16, 5, 1000, 400, 0.0, 150),
    ("bf16-g4-d64-window-cap", BF16, 4, 2, 64, 1, 4, 300, 130, 30.0, 37),
    ("fp32-g4-d64", FP32, 4, 2, 64, 16, 4, 600, 100, 0.0, -1),
    ("bf16-g6-d96", BF16, 6, 1, 96, 16, 3, 700, 150, 0.0, -1),
]


def run_extend_case(
    dtype: torch.dtype, group: int, kv_heads: int, head_dim: int, page_size: int, bs: int,
    max_prefix: int, max_extend: int, cap: float, window: int,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the extend kernel on a random paged batch; returns (output, float64 reference)."""
    prefix_lens = random_lens(bs, 0, max_prefix)
    extend_lens = random_lens(bs, 1, max_extend)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pools = PagedPools(seq_lens, page_size, kv_heads, head_dim, dtype)
    num_heads, tokens = group * kv_heads, sum(extend_lens)
    q_scale = 8.0 if cap > 0 else 1.0
    q = torch.randn(tokens, num_heads, head_dim, dtype=dtype, device=DEV) * q_scale
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=DEV)
    v = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=DEV)
    out = torch.full_like(q, float("nan"))
    starts = [sum(extend_lens[:i]) for i in range(bs)]

    def dev(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=DEV)

    scale = head_dim**-0.5
    # The new tokens' K/V are NOT in the pool (their slots hold noise): the kernel must use k/v.
    extend_attention_fwd(
        q, k, v, out, pools.k_buffer, pools.v_buffer, pools.req.req_to_token, pools.indices(),
        dev(prefix_lens), dev(extend_lens), dev(starts), max(extend_lens), scale, cap, window,
        config=config,
    )
    ref = reference_extend(q, k, v, pools.k_buffer, pools.v_buffer, pools.req.req_to_token,
                           pools.req_slots, prefix_lens, extend_lens, scale, cap, window)
    return out, ref


@pytest.mark.parametrize(
    "dtype,group,kv_heads,head_dim,page_size,bs,max_prefix,max_extend,cap,window",
    [c[1:] for c in EXTEND_CASES], ids=[c[0] for c in EXTEND_CASES],
)
def test_extend_kernel_matches_reference(
    seed: int, dtype: torch.dtype, group: int, kv_heads: int, head_dim: int, page_size: int,
    bs: int, max_prefix: int, max_extend: int, cap: float, window: int,
) -> None:
    out, ref = run_extend_case(dtype, group, kv_heads, head_dim, page_size, bs, max_prefix,
                               max_extend, cap, window)
    assert_matches(out, ref, dtype, f"extend seed={seed}")


@pytest.mark.parametrize("window", [-1, 90])
@pytest.mark.parametrize("config", [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3),
                                    (128, 128, 8, 2), (64, 128, 4, 2), (32, 32, 4, 2)])
def test_extend_tile_configs(seed: int, config: tuple[int, int, int, int], window: int) -> None:
    # (64, 128) has BLOCK_N > BLOCK_M: the causal loop cannot skip its mask there.
    out, ref = run_extend_case(BF16, 4, 2, 128, 16, 5, 700, 300, 0.0, window, config=config)
    assert_matches(out, ref, BF16, f"extend config={config} seed={seed}")


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("heads_inner", [False, True], ids=["rows-inner", "heads-inner"])
@pytest.mark.parametrize("pool_dtype,words", [(BF16, 0), (FP8, 1), (FP8, 0), (FP8, 2), (FP8, 3)],
                         ids=["bf16", "fp8-words", "fp8-widen", "fp8-f16", "fp8-words-f16"])
@pytest.mark.parametrize("block_n,num_warps,num_stages,slots_ahead",
                         [(16, 4, 3, False), (32, 4, 2, False), (128, 4, 3, False), (64, 8, 3, False),
                          (64, 4, 2, False), (32, 4, 4, True), (32, 2, 3, True), (16, 1, 2, True),
                          (64, 8, 3, True), (16, 1, 3, True), (32, 1, 3, True)])
def test_decode_tile_configs(seed: int, block_n: int, num_warps: int, num_stages: int, slots_ahead: bool,
                             pool_dtype: torch.dtype, words: int, heads_inner: bool) -> None:
    seq_lens = random_lens(6, 1, 1700)
    pools = PagedPools(seq_lens, 16, 2, 128, BF16)
    # An fp8 pool holds the bf16 values rounded to e4m3; the reference reads the same rounded values.
    k, v = pools.k_buffer.to(pool_dtype), pools.v_buffer.to(pool_dtype)
    q = torch.randn(6, 8, 128, dtype=BF16, device=DEV)
    out = torch.full_like(q, float("nan"))
    part_out = torch.full((6, 8, 7, 128), float("nan"), device=DEV)
    part_lse = torch.full((6, 8, 7), float("nan"), device=DEV)
    for splits in (7, 1):
        decode_attention_fwd(
            q, k, v, out, pools.req.req_to_token, pools.indices(), torch.tensor(seq_lens, device=DEV),
            part_out, part_lse, splits, 128**-0.5, block_n=block_n, num_warps=num_warps,
            num_stages=num_stages, slots_ahead=slots_ahead, words=words, heads_inner=heads_inner,
        )
        ref = reference_decode(q, k.float(), v.float(), pools.req.req_to_token, pools.req_slots, seq_lens,
                               128**-0.5)
        assert_matches(out, ref, BF16, f"decode tiles={block_n, num_warps, num_stages, slots_ahead} "
                                       f"splits={splits} pool={pool_dtype} words={words} "
                                       f"heads_inner={heads_inner} seed={seed}")


@pytest.mark.parametrize("words", [2, 3])
@pytest.mark.parametrize("q_scale", [1.0, 3e4, 1e6], ids=["q1", "q3e4", "q1e6"])
def test_fp8_f16_path_keeps_queries_beyond_the_float16_range(seed: int, q_scale: float, words: int) -> None:
    """words=2 and 3 attend with q in float16: a row whose q exceeds float16's range (65504) must still
    match (the kernel scales such a tile by 2^-16 and its scores by 2^16)."""
    seq_lens = random_lens(5, 1, 900)
    pools = PagedPools(seq_lens, 1, 2, 128, BF16)
    k, v = pools.k_buffer.to(FP8), pools.v_buffer.to(FP8)
    # Scores stay O(1..10): k is O(1), so q's scale is undone by the softmax scale.
    q = torch.randn(5, 8, 128, dtype=BF16, device=DEV) * q_scale
    scale = 0.3 / q_scale / 128**0.5
    out = torch.full_like(q, float("nan"))
    part = torch.full((5, 8, 1, 128), float("nan"), device=DEV)
    decode_attention_fwd(q, k, v, out, pools.req.req_to_token, pools.indices(), torch.tensor(seq_lens, device=DEV),
                         part, part[..., 0], 1, scale, words=words)
    ref = reference_decode(q, k.float(), v.float(), pools.req.req_to_token, pools.req_slots, seq_lens, scale)
    assert_matches(out, ref, BF16, f"words={words} q_scale={q_scale} seed={seed}")


def test_fp8_default_tiles_at_a_large_batch(seed: int) -> None:
    """One split at ``ONE_WARP_PROGRAMS`` programs or more (900 rows, 8 KV heads), as a decode graph at that
    batch runs it: ``decode_fp8_mma`` (``DecodeTiles.mma_block_n``), or with ``MMA_IN_REGISTERS`` off the one-warp,
    16-key tiles over words widened to float16 (``words`` 3); both here."""
    from engine_attention_triton.decode_attention import ONE_WARP_PROGRAMS

    seq_lens = random_lens(900, 1, 100)
    assert 900 * 8 >= ONE_WARP_PROGRAMS
    pools = PagedPools(seq_lens, 1, 8, 128, BF16)
    k, v = pools.k_buffer.to(FP8), pools.v_buffer.to(FP8)
    q = torch.randn(900, 32, 128, dtype=BF16, device=DEV)
    out = torch.full_like(q, float("nan"))
    part = torch.full((900, 32, 1, 128), float("nan"), device=DEV)
    ref = reference_decode(q, k.float() * 0.5, v.float() * 2.0, pools.req.req_to_token, pools.req_slots, seq_lens,
                           128**-0.5)
    for mma in (True, False):
        out.fill_(float("nan"))
        with mock.patch.object(decode_attention, "MMA_IN_REGISTERS", mma):
            decode_attention_fwd(q, k, v, out, pools.req.req_to_token, pools.indices(),
                                 torch.tensor(seq_lens, device=DEV), part, part[..., 0], 1, 128**-0.5, k_scale=0.5,
                                 v_scale=2.0, pdl=has_pdl(q.device))
        assert_matches(out, ref, BF16, f"900 rows, default tiles, MMA_IN_REGISTERS={mma} seed={seed}")


def one_e4m3_key_per_row(q_heads: int) -> tuple[torch.Tensor, ...]:
    """Rows that attend to one key each, row i's K and V holding e4m3 bit pattern i (all 254 but NaN)
    in every dim: (bits, their e4m3 values, K pool, V pool, req_to_token, bf16 q of ``q_heads`` heads);
    slot 0 of the pools is unused. With one key a row's output is that value, which bf16 holds exactly."""
    bits = torch.arange(256, dtype=torch.int32, device=DEV).to(torch.uint8)
    bits = bits[(bits & 0x7F) != 0x7F]
    values = bits.view(FP8)
    n = values.numel()
    k = torch.zeros(n + 1, 1, 128, dtype=FP8, device=DEV)
    k[1:] = values[:, None, None]
    req_to_token = torch.zeros(n, 16, dtype=torch.int32, device=DEV)
    req_to_token[:, 0] = torch.arange(1, n + 1, dtype=torch.int32, device=DEV)
    q = torch.randn(n, q_heads, 128, dtype=BF16, device=DEV)
    return bits, values, k, k.clone(), req_to_token, q


def test_fp8_words_widen_every_e4m3_value_exactly() -> None:
    """Row i attends to one key whose V holds e4m3 bit pattern i (all 254 but NaN) in every dim: with
    one key the output is that value, which bf16 holds exactly (subnormals included)."""
    bits, values, k, v, req_to_token, q = one_e4m3_key_per_row(1)
    n = values.numel()
    for slots_ahead, words in ((False, 1), (True, 1), (True, 2), (False, 3), (True, 3)):
        out = torch.full_like(q, float("nan"))
        part = torch.empty(n, 1, 1, 128, device=DEV)
        decode_attention_fwd(q, k, v, out, req_to_token, torch.arange(n, device=DEV),
                             torch.ones(n, dtype=torch.int64, device=DEV), part, part[..., 0], 1, 1.0,
                             slots_ahead=slots_ahead, words=words)
        want = values.to(BF16)[:, None].expand(n, 128)
        bad = (out[:, 0].float() != want.float()).any(1)  # value compare: -0 may come out +0
        assert not bad.any(), f"slots_ahead={slots_ahead} words={words}: wrong for e4m3 bits {bits[bad].tolist()}"


# -- the backend, through ForwardBatch -------------------------------------------------


def layer_info(num_heads: int, kv_heads: int, head_dim: int, cap: float = 0.0,
               window: int = -1) -> AttentionLayerInfo:
    return AttentionLayerInfo(layer_id=0, num_heads=num_heads, num_kv_heads=kv_heads,
                              head_dim=head_dim, scaling=head_dim**-0.5, logit_cap=cap,
                              sliding_window_size=window)


def split_qkv(tokens: int, num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q, k, v as column views of one fused projection, like a real QKV layer gives them."""
    qkv = torch.randn(tokens, (num_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEV)
    return qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)


@pytest.mark.parametrize("dtype,page_size,window", [(BF16, 16, -1), (FP16, 1, 64)])
def test_backend_mixed_batch(seed: int, dtype: torch.dtype, page_size: int, window: int) -> None:
    num_heads, kv_heads, head_dim = 16, 2, 128
    prefix_lens = random_lens(3, 0, 900) + [s - 1 for s in random_lens(5, 1, 1300)]
    extend_lens = random_lens(3, 1, 200) + [1] * 5
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pools = PagedPools(seq_lens, page_size, kv_heads, head_dim, dtype)
    backend = create(pools.context(num_heads, dtype))
    out_cache_loc = torch.cat([s[p:] for s, p in zip(pools.row_slots, prefix_lens)])
    fb = ForwardBatch.build(ForwardMode.MIXED, [0] * len(out_cache_loc), pools.req_slots,
                            seq_lens, prefix_lens, out_cache_loc, DEV, num_extend_reqs=3)
    fb.token_to_kv_pool, fb.req_to_token_pool = pools.kv, pools.req
    q, k, v = split_qkv(len(out_cache_loc), num_heads, kv_heads, head_dim, dtype)
    layer = layer_info(num_heads, kv_heads, head_dim, window=window)
    prefix_k, prefix_v = pools.k_buffer.clone(), pools.v_buffer.clone()

    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)

    shape = (-1, kv_heads, head_dim)
    assert torch.equal(pools.k_buffer[out_cache_loc], k.reshape(shape)), "K not saved"
    assert torch.equal(pools.v_buffer[out_cache_loc], v.reshape(shape)), "V not saved"
    ref = reference_extend(q.reshape(-1, num_heads, head_dim), k.reshape(shape), v.reshape(shape),
                           prefix_k, prefix_v, pools.req.req_to_token, pools.req_slots,
                           prefix_lens, extend_lens, layer.scaling, 0.0,
                           # the layer's window W means q - k < W; the reference takes q - k <= w
                           window - 1 if window > 0 else window)
    assert_matches(out.view(-1, num_heads, head_dim), ref, dtype, f"mixed seed={seed}")


def test_backend_warmup_compiles_the_extend_kernels(seed: int) -> None:
    """After ``warmup``, a prefill chunk (512+ new tokens) and a short extend compile nothing more.
    A window no other test uses keeps the variants this test's own (the first count must grow)."""
    from engine_attention_triton.extend_attention import _extend_kernel

    def compiled() -> int:
        return sum(len(cache[0]) for cache in _extend_kernel.device_caches.values())

    num_heads, kv_heads, head_dim, window = 32, 8, 128, 53
    layer = layer_info(num_heads, kv_heads, head_dim, window=window)
    for extend_lens, label in (([600, 20], "chunk"), ([20, 30], "short")):
        pools = PagedPools(extend_lens, 1, kv_heads, head_dim, BF16)
        backend = create(pools.context(num_heads, BF16))
        if label == "chunk":
            before = compiled()
            backend.warmup([layer])
            warmed = compiled()
            assert warmed >= before + 2, f"warmup compiled {warmed - before} extend variants, expected 2"
        out_cache_loc = torch.cat(pools.row_slots)
        fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * len(out_cache_loc), pools.req_slots, extend_lens,
                                [0] * len(extend_lens), out_cache_loc, DEV, num_extend_reqs=len(extend_lens))
        fb.token_to_kv_pool, fb.req_to_token_pool = pools.kv, pools.req
        q, k, v = split_qkv(len(out_cache_loc), num_heads, kv_heads, head_dim, BF16)
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, layer, fb)
        assert compiled() == warmed, f"{label}: the extend kernel compiled after warmup"
        shape = (-1, kv_heads, head_dim)
        ref = reference_extend(q.reshape(-1, num_heads, head_dim), k.reshape(shape), v.reshape(shape),
                               pools.k_buffer, pools.v_buffer, pools.req.req_to_token, pools.req_slots,
                               [0] * len(extend_lens), extend_lens, layer.scaling, 0.0, window - 1)
        assert_matches(out.view(-1, num_heads, head_dim), ref, BF16, f"{label} seed={seed}")


@pytest.mark.parametrize("bs,page_size,cap", [(1, 1, 0.0), (64, 16, 0.0), (5, 16, 25.0)])
def test_backend_decode(seed: int, bs: int, page_size: int, cap: float) -> None:
    num_heads, kv_heads, head_dim, dtype = 32, 8, 128, BF16
    seq_lens = random_lens(bs, 1, 2000)
    pools = PagedPools(seq_lens, page_size, kv_heads, head_dim, dtype)
    backend = create(pools.context(num_heads, dtype))
    out_cache_loc = torch.stack([s[-1] for s in pools.row_slots])
    fb = ForwardBatch.build(ForwardMode.DECODE, [0] * bs, pools.req_slots, seq_lens,
                            [s - 1 for s in seq_lens], out_cache_loc, DEV)
    fb.token_to_kv_pool, fb.req_to_token_pool = pools.kv, pools.req
    q, k, v = split_qkv(bs, num_heads, kv_heads, head_dim, dtype)
    layer = layer_info(num_heads, kv_heads, head_dim, cap=cap)
    expect_k, expect_v = pools.k_buffer.clone(), pools.v_buffer.clone()
    expect_k[out_cache_loc] = k.reshape(bs, kv_heads, head_dim)
    expect_v[out_cache_loc] = v.reshape(bs, kv_heads, head_dim)

    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)

    assert torch.equal(pools.k_buffer, expect_k) and torch.equal(pools.v_buffer, expect_v)
    ref = reference_decode(q.reshape(bs, num_heads, head_dim), expect_k, expect_v,
                           pools.req.req_to_token, pools.req_slots, seq_lens, layer.scaling, cap)
    assert_matches(out.view(bs, num_heads, head_dim), ref, dtype, f"backend decode seed={seed}")


def test_cuda_graph_decode_replays_new_lengths(seed: int) -> None:
    """Captures decode at bs=8, then replays on other rows, lengths and inputs."""
    bs, num_heads, kv_heads, head_dim, dtype = 8, 32, 8, 128, BF16
    capacity = random_lens(16, 1, 3000)  # 16 candidate rows; each replay uses 8 of them
    pools = PagedPools(capacity, 16, kv_heads, head_dim, dtype)
    backend = create(pools.context(num_heads, dtype, max_kv_splits=16))
    layer = layer_info(num_heads, kv_heads, head_dim)

    def draw() -> tuple[list[int], list[int], torch.Tensor]:
        rows = random.sample(range(16), bs)
        lens = [random.randint(1, capacity[r]) for r in rows]
        locs = torch.stack([pools.row_slots[r][n - 1] for r, n in zip(rows, lens)])
        return [pools.req_slots[r] for r in rows], lens, locs

    slots, lens, locs = draw()
    fb = ForwardBatch.build(ForwardMode.DECODE, [0] * bs, slots, lens, [n - 1 for n in lens],
                            locs, DEV)
    fb.token_to_kv_pool, fb.req_to_token_pool = pools.kv, pools.req
    q_s, k_s, v_s = (t.contiguous() for t in split_qkv(bs, num_heads, kv_heads, head_dim, dtype))
    backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    backend.init_forward_metadata_capture_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels outside the capture
        backend.forward_decode(q_s, k_s, v_s, layer, fb)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = backend.forward_decode(q_s, k_s, v_s, layer, fb)

    for replay in range(3):
        slots, lens, locs = draw()
        for t in (q_s, k_s, v_s):
            t.copy_(torch.randn_like(t))
        fb.out_cache_loc.copy_(locs)
        out_s.fill_(float("nan"))
        backend.init_forward_metadata_replay_cuda_graph(
            bs, torch.tensor(slots, device=DEV), torch.tensor(lens, device=DEV), lens
        )
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(pools.k_buffer[locs], k_s.view(bs, kv_heads, head_dim))
        ref = reference_decode(q_s.view(bs, num_heads, head_dim), pools.k_buffer, pools.v_buffer,
                               pools.req.req_to_token, slots, lens, layer.scaling)
        assert_matches(out_s.view(bs, num_heads, head_dim), ref, dtype,
                       f"graph replay {replay} seed={seed} lens={lens}")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90+")
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_pdl_decode_after_the_prologue_equals_plain_launches(seed: int, splits: int) -> None:
    """Decode with ``pdl`` launched right after the platform's attention prologue with ``pdl``, which
    lets it start before storing the newest K/V: the split kernel must take that position from after
    its wait. Bit-equal to both launched without PDL, eagerly and replayed in a CUDA graph, with the
    newest slots holding stale values before every step (lengths put the newest key first in a block,
    last in one, and deep in a long row)."""
    prologue = pytest.importorskip("engine_platform_cuda.prologue")
    num_heads, kv_heads, head_dim = 32, 4, 128
    lens = [1, 64, 65, 1000, 129]
    bs = len(lens)
    pools = PagedPools(lens, 1, kv_heads, head_dim, BF16)
    k_cache, v_cache = pools.k_buffer, pools.v_buffer
    locs = torch.stack([slots[n - 1] for slots, n in zip(pools.row_slots, lens)])
    positions = torch.tensor([n - 1 for n in lens], device=DEV)
    seq_lens = torch.tensor(lens, device=DEV)
    idx = pools.indices()
    q0, k, v = (t.contiguous() for t in split_qkv(bs, num_heads, kv_heads, head_dim, BF16))
    q = torch.empty_like(q0)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    freqs = torch.outer(torch.arange(2048, device=DEV).float(), inv)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    part_out = torch.empty(bs, num_heads, splits, head_dim, device=DEV)
    part_lse = torch.empty(bs, num_heads, splits, device=DEV)
    stale = torch.randn(bs, kv_heads, head_dim, device=DEV).to(BF16)

    def step(pdl: bool) -> torch.Tensor:
        q.copy_(q0)
        k_cache[locs] = stale
        v_cache[locs] = stale
        prologue.qkv_prologue(positions, q, k, v, k_cache, v_cache, locs, cos, sin, head_dim, pdl=pdl)
        out = torch.empty(bs, num_heads, head_dim, dtype=BF16, device=DEV)
        decode_attention_fwd(q.view(bs, num_heads, head_dim), k_cache, v_cache, out, pools.req.req_to_token,
                             idx, seq_lens, part_out, part_lse, splits, head_dim**-0.5, pdl=pdl)
        return out

    plain = step(False)
    assert torch.equal(step(True), plain), f"eager PDL launches differ, seed={seed}"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(True)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain), f"graph replay with PDL differs, seed={seed}"


def test_unknown_option_is_a_clear_error() -> None:
    pools = PagedPools([4], 1, 1, 64, BF16)
    with pytest.raises(ValueError, match="max_kv_splits"):
        create(pools.context(4, BF16, max_kv_split=4))
    with pytest.raises(ValueError, match=r"attention.triton.pdl=2; accepted: on/off"):
        create(pools.context(4, BF16, pdl=2))
