"""The MLA kernels (``mla_attention``) against torch references under Triton's interpreter.

Tiny DeepSeek-like shapes: 4 query heads over one latent KV head of kv_lora_rank 32 plus a
16-dim rope key (48 in all, not a power of two); rows of 1..40 tokens on shuffled slots of a pool
filled with random data (a stray read changes the result), outputs poisoned with NaN first.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_attention_triton import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (set where no GPU is present)")

from engine_attention_triton.interpreter_compat import patch_interpreter_index  # noqa: E402
from engine_attention_triton.mla_attention import mla_decode_fwd, mla_extend_fwd  # noqa: E402
from engine_attention_triton.reference import reference_decode, reference_extend  # noqa: E402

HEADS, LORA, ROPE = 4, 32, 16
DIM = LORA + ROPE
SCALE = 0.3


class MLAPool:
    """One layer's latent+rope buffer with rows of the given lengths on shuffled slots."""

    def __init__(self, seq_lens: list[int], seed: int, dtype: torch.dtype = torch.float32) -> None:
        patch_interpreter_index()
        gen = torch.Generator().manual_seed(seed)
        slots = sum(seq_lens) + 9
        self.kv = torch.randn(slots, 1, DIM, generator=gen).to(dtype)
        order = torch.randperm(slots - 1, generator=gen) + 1  # slot 0 is padding
        self.req_to_token = torch.randint(0, slots, (len(seq_lens) + 2, max(seq_lens) + 5),
                                          generator=gen, dtype=torch.int32)
        self.rows = [len(seq_lens) + 1 - i for i in range(len(seq_lens))]  # not 0..n-1
        self.row_slots = []
        used = 0
        for row, n in zip(self.rows, seq_lens):
            locs = order[used:used + n]
            used += n
            self.req_to_token[row, :n] = locs.to(torch.int32)
            self.row_slots.append(locs)


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str, atol: float = 1e-4) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten)"
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= atol, f"{what}: max abs err {err:.3g} (limit {atol})"


@pytest.mark.parametrize("early_kv", [False, True])
@pytest.mark.parametrize("slots_ahead", [False, True])
@pytest.mark.parametrize("splits, heads", [(1, HEADS), (3, 20)])
def test_mla_decode_matches_reference(splits: int, heads: int, slots_ahead: bool, early_kv: bool) -> None:
    """20 heads: two blocks of query heads, the second 4 of 16 live. Both loops (the slots-ahead
    one is what an e4m3 pool runs on the GPU; here over a float32 pool), each with the first block
    gathered apart (``early_kv``, as with PDL: there before the wait, here in the same order)."""
    seq_lens = [1, 17, 40, 33]
    pool = MLAPool(seq_lens, seed=splits)
    bs = len(seq_lens)
    q = torch.randn(bs, heads, DIM)
    out = torch.full((bs, heads, LORA), float("nan"))
    part_out = torch.full((bs, heads, 4, LORA), float("nan"))
    part_lse = torch.full((bs, heads, 4), float("nan"))
    mla_decode_fwd(q, pool.kv, out, pool.req_to_token, torch.tensor(pool.rows), torch.tensor(seq_lens),
                   part_out, part_lse, splits, SCALE, LORA, block_n=16, slots_ahead=slots_ahead, early_kv=early_kv)
    ref = reference_decode(q, pool.kv, pool.kv[..., :LORA], pool.req_to_token, pool.rows, seq_lens, SCALE)
    assert_close(out, ref, f"decode splits={splits} slots_ahead={slots_ahead} early_kv={early_kv}")


def test_mla_decode_equals_the_unabsorbed_attention() -> None:
    """The latent output times W_UV equals MLA computed the long way: per-head keys
    ``[c @ W_UK || k_pe]`` and values ``c @ W_UV``, queries ``[q_nope || q_pe]``."""
    nope, v_dim, seq = 8, 8, 21
    pool = MLAPool([seq], seed=7)
    w_uk = torch.randn(HEADS, nope, LORA) / LORA**0.5
    w_uv = torch.randn(HEADS, v_dim, LORA) / LORA**0.5
    q_nope, q_pe = torch.randn(1, HEADS, nope), torch.randn(1, HEADS, ROPE)
    q = torch.cat((torch.einsum("bhn,hnc->bhc", q_nope, w_uk), q_pe), dim=-1)
    out = torch.empty(1, HEADS, LORA)
    part_out, part_lse = torch.empty(1, HEADS, 2, LORA), torch.empty(1, HEADS, 2)
    mla_decode_fwd(q, pool.kv, out, pool.req_to_token, torch.tensor(pool.rows), torch.tensor([seq]),
                   part_out, part_lse, 2, SCALE, LORA, block_n=16)
    latent = pool.kv[pool.row_slots[0], 0].double()  # [seq, 48]
    keys = torch.cat((torch.einsum("lc,hnc->hln", latent[:, :LORA], w_uk.double()),
                      latent[:, LORA:].expand(HEADS, seq, ROPE)), dim=-1)
    values = torch.einsum("lc,hvc->hlv", latent[:, :LORA], w_uv.double())
    query = torch.cat((q_nope, q_pe), dim=-1)[0].double()  # [heads, nope + rope]
    probs = torch.softmax(torch.einsum("hd,hld->hl", query, keys) * SCALE, dim=-1)
    expect = torch.einsum("hl,hlv->hv", probs, values)
    got = torch.einsum("hc,hvc->hv", out[0].double(), w_uv.double())
    assert_close(got, expect, "absorbed vs expanded")


def run_extend(prefix_lens: list[int], extend_lens: list[int], seed: int,
               tree: list[torch.Tensor] | None = None) -> None:
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = MLAPool(seq_lens, seed=seed)
    tokens = sum(extend_lens)
    q = torch.randn(tokens, HEADS, DIM)
    k_new = torch.randn(tokens, 1, DIM)
    out = torch.full((tokens, HEADS, LORA), float("nan"))
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    tree_mask = tree_indptr = None
    if tree is not None:
        tree_mask = torch.cat([m.reshape(-1) for m in tree])
        tree_indptr = torch.tensor([0] + [m.numel() for m in tree]).cumsum(0)[:-1]
    mla_extend_fwd(q, k_new, out, pool.kv, pool.req_to_token, torch.tensor(pool.rows),
                   torch.tensor(prefix_lens), torch.tensor(extend_lens), torch.tensor(starts),
                   max(extend_lens), SCALE, LORA, tree_mask=tree_mask, tree_mask_indptr=tree_indptr)
    if tree is None:
        ref = reference_extend(q, k_new, k_new[..., :LORA], pool.kv, pool.kv[..., :LORA], pool.req_to_token,
                               pool.rows, prefix_lens, extend_lens, SCALE)
        assert_close(out, ref, f"extend prefixes={prefix_lens} lens={extend_lens}")
        return
    for i, (row, prefix, n) in enumerate(zip(pool.rows, prefix_lens, extend_lens)):
        keys = torch.cat((pool.kv[pool.req_to_token[row, :prefix].long(), 0], k_new[starts[i]:starts[i] + n, 0]))
        scores = torch.einsum("thd,ld->htl", q[starts[i]:starts[i] + n].double(), keys.double()) * SCALE
        visible = torch.cat((torch.ones(n, prefix, dtype=torch.bool), tree[i]), dim=1)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        ref = torch.einsum("htl,lc->thc", probs, keys[:, :LORA].double())
        assert_close(out[starts[i]:starts[i] + n], ref, f"tree extend row {i}")


def test_mla_extend_prefix_hits_and_decode_rows() -> None:
    """An empty prefix, prefix hits (a chunk after a cached prefix), and decode rows (one new token)
    in one batch, as a MIXED batch has them; a 40-token row spans blocks of both loops."""
    run_extend([0, 13, 39, 5], [40, 7, 1, 1], seed=3)


def test_mla_extend_tree_mask() -> None:
    """Speculative tree verification: new tokens see the prefix and only their ancestors."""
    chain = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    branch = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    run_extend([6, 11], [3, 4], seed=random.Random(5).randrange(100), tree=[chain, branch])


def test_mla_fp8_pool_reads_the_stored_latent_times_its_scale() -> None:
    seq_lens = [9, 23]
    scale = 0.5
    pool = MLAPool(seq_lens, seed=11, dtype=torch.float8_e4m3fn)
    bs = len(seq_lens)
    q = torch.randn(bs, HEADS, DIM)
    out = torch.empty(bs, HEADS, LORA)
    part_out, part_lse = torch.empty(bs, HEADS, 2, LORA), torch.empty(bs, HEADS, 2)
    mla_decode_fwd(q, pool.kv, out, pool.req_to_token, torch.tensor(pool.rows), torch.tensor(seq_lens),
                   part_out, part_lse, 2, SCALE, LORA, kv_scale=scale, block_n=16)
    wide = pool.kv.float() * scale
    ref = reference_decode(q, wide, wide[..., :LORA], pool.req_to_token, pool.rows, seq_lens, SCALE)
    assert_close(out, ref, "fp8 decode")


@pytest.mark.parametrize("early_kv", [False, True])
@pytest.mark.parametrize("widen", ["f16", "cvt"])
def test_mla_fp8_pool_under_16_bit_queries(widen: str, early_kv: bool) -> None:
    """16-bit queries over an e4m3 pool: widened to float16 with q converted (the default) or to
    q's dtype; the slots-ahead loop, with and without the first block gathered apart. (The
    interpreter's bfloat16 is not faithful: float16 here.)"""
    seq_lens = [9, 23]
    pool = MLAPool(seq_lens, seed=12, dtype=torch.float8_e4m3fn)
    bs = len(seq_lens)
    q = torch.randn(bs, HEADS, DIM).half()
    out = torch.full((bs, HEADS, LORA), float("nan"), dtype=torch.float16)
    part_out, part_lse = torch.empty(bs, HEADS, 2, LORA), torch.empty(bs, HEADS, 2)
    mla_decode_fwd(q, pool.kv, out, pool.req_to_token, torch.tensor(pool.rows), torch.tensor(seq_lens),
                   part_out, part_lse, 2, SCALE, LORA, kv_scale=0.5, block_n=16, widen=widen, slots_ahead=True,
                   early_kv=early_kv)
    wide = pool.kv.float() * 0.5
    ref = reference_decode(q.float(), wide, wide[..., :LORA], pool.req_to_token, pool.rows, seq_lens, SCALE)
    assert_close(out, ref, f"fp8 decode widen={widen} early_kv={early_kv}", atol=3e-3)


def test_mla_widen_is_checked() -> None:
    pool = MLAPool([3], seed=1, dtype=torch.float8_e4m3fn)
    q = torch.randn(1, HEADS, DIM).half()
    with pytest.raises(ValueError, match="widen='words'"):  # needs bf16 q and compiled inline PTX
        mla_decode_fwd(q, pool.kv, torch.empty(1, HEADS, LORA, dtype=torch.float16), pool.req_to_token,
                       torch.tensor(pool.rows), torch.tensor([3]), torch.empty(1, HEADS, 1, LORA),
                       torch.empty(1, HEADS, 1), 1, SCALE, LORA, widen="words")


@pytest.mark.parametrize("rows, dtype, pool_dtype, pdl, early", [
    (1, torch.bfloat16, torch.bfloat16, True, True), (4, torch.float16, torch.float16, True, True),
    (5, torch.bfloat16, torch.bfloat16, True, False), (1, torch.bfloat16, torch.bfloat16, False, False),
    (1, torch.float32, torch.float32, True, False), (1, torch.bfloat16, torch.float8_e4m3fn, True, False)])
def test_mla_decode_gathers_early_at_small_batches_with_pdl(monkeypatch: pytest.MonkeyPatch, rows: int,
                                                           dtype: torch.dtype, pool_dtype: torch.dtype, pdl: bool,
                                                           early: bool) -> None:
    """The default: the first block gathered before the PDL wait, in 16-key blocks, only with PDL
    over a 16-bit pool and queries at up to MLA_EARLY_KV_MAX_ROWS rows (the plain loop: 16 splits)."""
    from engine_attention_triton import mla_attention

    launches: list[dict] = []

    class Recorder:
        def __getitem__(self, grid: tuple) -> object:
            return lambda *args, **meta: launches.append(meta)

    monkeypatch.setattr(mla_attention, "_mla_decode_split_kernel", Recorder())
    monkeypatch.setattr(mla_attention, "_decode_merge_kernel", Recorder())
    monkeypatch.setattr(mla_attention, "gathers_words", lambda *a: False)
    q = torch.randn(rows, HEADS, DIM).to(dtype)
    kv = torch.zeros(8, 1, DIM).to(pool_dtype)
    mla_decode_fwd(q, kv, torch.empty(rows, HEADS, LORA, dtype=dtype), torch.zeros(rows, 4, dtype=torch.int32),
                   torch.arange(rows), torch.ones(rows, dtype=torch.int64), torch.empty(rows, HEADS, 16, LORA),
                   torch.empty(rows, HEADS, 16), 16, SCALE, LORA, pdl=pdl)
    meta = launches[0]
    assert (meta["EARLY_KV"], meta["BLOCK_N"]) == ((True, 16) if early else (False, 32)), meta


def test_mla_shapes_are_checked() -> None:
    q = torch.randn(2, HEADS, DIM)
    kv = torch.randn(10, 2, DIM)
    with pytest.raises(ValueError, match=r"shape \(10, 2, 48\); accepted: \[slots, 1, 48\]"):
        mla_decode_fwd(q, kv, torch.empty(2, HEADS, LORA), torch.zeros(2, 4, dtype=torch.int32),
                       torch.tensor([0, 1]), torch.tensor([1, 1]), torch.empty(2, HEADS, 1, LORA),
                       torch.empty(2, HEADS, 1), 1, SCALE, LORA)


def test_backend_reads_the_mla_pool_in_mixed_and_decode_batches() -> None:
    """The backend on an ``MLATokenToKVPool`` (page size 4): a MIXED batch (a fresh prompt, a chunk
    after a cached prefix, a decode row) saves each k row once and attends like the reference,
    then a decode step over the rows it left, planned as a CUDA graph's would be."""
    from engine_attention_triton.backend import create

    from engine.attention import AttentionContext, AttentionLayerInfo
    from engine.layers.forward_batch import ForwardBatch, ForwardMode
    from engine.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool

    torch.manual_seed(0)
    page = 4
    kv = MLATokenToKVPool(96, page, torch.float32, LORA, ROPE, 1, "cpu")
    kv.get_key_buffer(0).normal_()
    req = ReqToTokenPool(4, 32, "cpu")
    pages = (torch.randperm(96 // page) + 1) * page  # shuffled pages; page 0 takes padding writes
    for slot in range(3):
        req.req_to_token[slot] = (pages[slot * 8:slot * 8 + 8, None] + torch.arange(page)).reshape(-1)
    ctx = AttentionContext(device=torch.device("cpu"), dtype=torch.float32, num_layers=1, num_heads=HEADS,
                           num_kv_heads=1, head_dim=DIM, page_size=page, max_context_len=32,
                           req_to_token_pool=req, token_to_kv_pool=kv, options={"max_kv_splits": 3})
    backend = create(ctx)
    layer = AttentionLayerInfo(layer_id=0, num_heads=HEADS, num_kv_heads=1, head_dim=DIM, scaling=SCALE,
                               v_head_dim=LORA, kv_layout="mla")
    slots, prefix_lens, seq_lens = [2, 0, 1], [0, 13, 20], [11, 30, 21]
    loc = torch.cat([req.req_to_token[s, p:n].long() for s, p, n in zip(slots, prefix_lens, seq_lens)])
    fb = ForwardBatch.build(ForwardMode.MIXED, [0] * len(loc), slots, seq_lens, prefix_lens, loc, "cpu",
                            num_extend_reqs=2)
    fb.token_to_kv_pool, fb.req_to_token_pool = kv, req
    q, k = torch.randn(len(loc), HEADS * DIM), torch.randn(len(loc), DIM)
    before = kv.get_key_buffer(0).clone()
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, k[:, :LORA], layer, fb)
    assert torch.equal(kv.get_key_buffer(0)[loc, 0], k), "k rows not saved"
    extend_lens = [n - p for n, p in zip(seq_lens, prefix_lens)]
    k3 = k.view(-1, 1, DIM)
    ref = reference_extend(q.view(-1, HEADS, DIM), k3, k3[..., :LORA], before, before[..., :LORA],
                           req.req_to_token, slots, prefix_lens, extend_lens, SCALE)
    assert_close(out.view(-1, HEADS, LORA), ref, "backend mixed")

    seq_lens = [n + 1 for n in seq_lens]
    loc = torch.stack([req.req_to_token[s, n - 1].long() for s, n in zip(slots, seq_lens)])
    fb = ForwardBatch.build(ForwardMode.DECODE, [0] * 3, slots, seq_lens, [n - 1 for n in seq_lens], loc, "cpu")
    fb.token_to_kv_pool, fb.req_to_token_pool = kv, req
    q, k = torch.randn(3, HEADS * DIM), torch.randn(3, DIM)
    # The CUDA-graph metadata path (run eagerly here): the split count from the batch size alone.
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    backend.init_forward_metadata_capture_cuda_graph(3, fb.req_pool_indices, fb.seq_lens)
    backend.init_forward_metadata_replay_cuda_graph(3, fb.req_pool_indices, fb.seq_lens, seq_lens)
    assert backend.forward_metadata.num_kv_splits == 3, "the decode step should exercise the split merge"
    out = backend.forward_decode(q, k, k[:, :LORA], layer, fb)
    buf = kv.get_key_buffer(0)
    ref = reference_decode(q.view(3, HEADS, DIM), buf, buf[..., :LORA], req.req_to_token, slots, seq_lens, SCALE)
    assert_close(out.view(3, HEADS, LORA), ref, "backend decode")
