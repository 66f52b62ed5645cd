"""The decode kernel's launch layouts against the float64 reference under Triton's interpreter.

Several KV heads per program (block-diagonal query tiles: a wrong column or row mask mixes heads)
and the heads-inner launch order, at GQA groups 1, 2 and 4, with and without splits, on rows of
1..70 tokens on shuffled slots of a pool filled with random data, outputs poisoned with NaN first.
float32 only: Triton's interpreter computes 16-bit ``tl.dot`` wrongly (the 16-bit and fp8 paths
are GPU tests in test_triton_kernels.py).
"""

from __future__ import annotations

import pytest
import torch
from engine_attention_triton import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (set where no GPU is present)")

from engine_attention_triton.decode_attention import decode_attention_fwd, kv_heads_per_program  # noqa: E402
from engine_attention_triton.interpreter_compat import patch_interpreter_index  # noqa: E402
from engine_attention_triton.reference import reference_decode  # noqa: E402

SCALE = 0.2


def _run(group: int, kv_heads: int, head_dim: int, per_program: int, heads_inner: bool, splits: int,
         seed: int, slots_ahead: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    patch_interpreter_index()
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [1, 70, 33, 17]
    slots = sum(seq_lens) + 7
    k = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(slots, kv_heads, head_dim, generator=gen)
    req_to_token = torch.randint(0, slots, (len(seq_lens) + 1, 80), generator=gen, dtype=torch.int32)
    order = torch.randperm(slots, generator=gen).to(torch.int32)
    rows = [4, 2, 0, 3]  # pool rows not in batch order
    used = 0
    for row, n in zip(rows, seq_lens, strict=True):
        req_to_token[row, :n] = order[used : used + n]
        used += n
    num_heads = group * kv_heads
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    part_out = torch.full((len(seq_lens), num_heads, splits + 1, head_dim), float("nan"))
    part_lse = torch.full((len(seq_lens), num_heads, splits + 1), float("nan"))
    reqs, lens = torch.tensor(rows), torch.tensor(seq_lens)
    decode_attention_fwd(q, k, v, out, req_to_token, reqs, lens, part_out, part_lse, splits, SCALE,
                         block_n=16, heads_inner=heads_inner, kv_per_program=per_program, slots_ahead=slots_ahead)
    return out, reference_decode(q, k, v, req_to_token, rows, seq_lens, SCALE)


@pytest.mark.parametrize("group,kv_heads,per_program,heads_inner,splits", [
    (4, 4, 2, False, 1), (4, 4, 4, True, 3), (2, 4, 4, False, 2), (1, 8, 8, True, 1), (4, 2, 1, True, 2),
])
def test_heads_per_program_and_order_match_reference(group: int, kv_heads: int, per_program: int,
                                                     heads_inner: bool, splits: int) -> None:
    out, ref = _run(group, kv_heads, 32, per_program, heads_inner, splits, seed=group * 100 + per_program)
    assert not torch.isnan(out).any(), "unwritten output"
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-4, f"per_program={per_program} heads_inner={heads_inner} splits={splits}: max err {err:.3g}"


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("slots_ahead", [False, True])
def test_each_loop_matches_reference(slots_ahead: bool, splits: int) -> None:
    """The plain and the slots-ahead loops (rows of 1..70 tokens: one to five blocks of 16, the last
    one partial, and empty splits)."""
    out, ref = _run(4, 2, 32, 1, True, splits, seed=int(slots_ahead) * 10 + splits, slots_ahead=slots_ahead)
    assert not torch.isnan(out).any(), "unwritten output"
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-4, f"slots_ahead={slots_ahead} splits={splits}: max err {err:.3g}"


def test_kv_heads_per_program_refuses_shapes_it_cannot_tile() -> None:
    assert kv_heads_per_program(8, 96, 96) == 1  # the default falls back where it does not fit
    for heads, dim, wanted in ((8, 96, 2), (6, 128, 4), (8, 128, 3)):
        with pytest.raises(ValueError, match="kv_per_program"):
            kv_heads_per_program(heads, dim, dim, wanted)


def test_words_override_names_what_it_needs() -> None:
    """``words`` 3 (words widened by inline PTX) needs a compiled CUDA kernel over an aligned e4m3 pool
    and bf16 q; anything else is refused with the reason, as is a mode that does not exist."""
    q = torch.randn(1, 4, 32, dtype=torch.bfloat16)
    k = torch.randn(8, 1, 32).to(torch.float8_e4m3fn)
    out = torch.empty_like(q)
    args = (q, k, k, out, torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64), torch.empty(1, 4, 1, 32), torch.empty(1, 4, 1), 1, SCALE)
    with pytest.raises(ValueError, match=r"words=3 needs an e4m3 pool with 4-byte aligned rows under bf16 q on CUDA"):
        decode_attention_fwd(*args, words=3)
    with pytest.raises(ValueError, match=r"words=5; accepted: 0, 1, 2, 3"):
        decode_attention_fwd(*args, words=5)


def test_one_split_tiles_follow_the_programs() -> None:
    """An e4m3 pool (words) with one split takes one-warp, 16-key tiles from ``ONE_WARP_PROGRAMS``
    programs (batch 384 at 8 KV heads), two warps and 32 keys below; the widening to float16 either way."""
    from engine_attention_triton.decode_attention import ONE_WARP_PROGRAMS, decode_tiles

    big = decode_tiles(torch.bfloat16, 128, 1, True, ONE_WARP_PROGRAMS)
    small = decode_tiles(torch.bfloat16, 128, 1, True, ONE_WARP_PROGRAMS - 8)
    two = decode_tiles(torch.bfloat16, 128, 2, True, ONE_WARP_PROGRAMS)
    assert (big.block_n, big.num_warps, big.num_stages, big.slots_ahead) == (16, 1, 3, True), big
    assert (small.block_n, small.num_warps) == (32, 2) == (two.block_n, two.num_warps), (small, two)
    assert big.widen_f16 and small.widen_f16 and two.widen_f16
    assert decode_tiles(torch.bfloat16, 128, 1, False, ONE_WARP_PROGRAMS).num_warps == 4  # a bf16 pool


def test_one_split_e4m3_decode_goes_to_decode_fp8_mma(monkeypatch: pytest.MonkeyPatch) -> None:
    """An e4m3 pool (words) with one split names ``decode_fp8_mma``'s block (``mma_block_n``): 16 keys
    from ``MMA_16_KEY_PROGRAMS`` programs, 32 below; 0 (the Triton tiles) with splits, over a 16-bit
    pool, with ``MMA_IN_REGISTERS`` off, or where this Triton has no Gluon (the module is None)."""
    from engine_attention_triton import decode_attention
    from engine_attention_triton.decode_attention import MMA_16_KEY_PROGRAMS, decode_tiles

    monkeypatch.setattr(decode_attention, "decode_fp8_mma", object())  # as where Gluon imports
    assert decode_tiles(torch.bfloat16, 128, 1, True, MMA_16_KEY_PROGRAMS).mma_block_n == 16
    assert decode_tiles(torch.bfloat16, 128, 1, True, MMA_16_KEY_PROGRAMS - 8).mma_block_n == 32
    assert decode_tiles(torch.bfloat16, 128, 1, True, 8).mma_block_n == 32
    assert decode_tiles(torch.bfloat16, 128, 2, True, MMA_16_KEY_PROGRAMS).mma_block_n == 0
    assert decode_tiles(torch.bfloat16, 128, 1, False, MMA_16_KEY_PROGRAMS).mma_block_n == 0
    monkeypatch.setattr(decode_attention, "MMA_IN_REGISTERS", False)
    assert decode_tiles(torch.bfloat16, 128, 1, True, MMA_16_KEY_PROGRAMS).mma_block_n == 0
    monkeypatch.setattr(decode_attention, "MMA_IN_REGISTERS", True)
    monkeypatch.setattr(decode_attention, "decode_fp8_mma", None)
    assert decode_tiles(torch.bfloat16, 128, 1, True, MMA_16_KEY_PROGRAMS).mma_block_n == 0


def test_decode_fp8_mma_refuses_what_it_does_not_take() -> None:
    """``decode_fp8_mma.fits`` and ``decode_fp8_mma_fwd``'s checks (before any launch): bf16 q over an e4m3
    pool, head dim 64 or 128, up to 8 query heads a KV head, whole-word strides and contiguous last dims;
    an ``out`` of q's shape; 16- or 32-key blocks."""
    pytest.importorskip("triton.experimental.gluon", reason="decode_fp8_mma is a Gluon kernel")
    from engine_attention_triton.decode_fp8_mma import decode_fp8_mma_fwd, fits

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    q = torch.zeros(2, 8, 128, dtype=bf16)
    k = torch.zeros(4, 2, 128, dtype=fp8)
    assert fits(q, k, k) and fits(q[..., :64], k[..., :64].contiguous(), k[..., :64].contiguous())
    assert not fits(q.half(), k, k)  # fp16 q
    assert not fits(q, k.to(bf16), k.to(bf16))  # a 16-bit pool
    assert not fits(q[..., :96], k[..., :96].contiguous(), k[..., :96].contiguous())  # head dim 96
    assert not fits(torch.zeros(2, 18, 128, dtype=bf16), k, k)  # 9 query heads a KV head
    assert not fits(torch.zeros(2, 128, 8, dtype=bf16).transpose(1, 2), k, k)  # q's last dim strided
    odd_rows = torch.zeros(4, 2, 130, dtype=fp8)[..., :128]  # a head's row not 4-byte aligned
    assert not fits(q, odd_rows, odd_rows)
    slots = (torch.zeros(2, 4, dtype=torch.int32), torch.arange(2), torch.ones(2, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError, match=r"head dims 64 or 128.*got q \(2, 8, 96\)"):
        decode_fp8_mma_fwd(q[..., :96], odd_rows[..., :96], odd_rows[..., :96], q[..., :96].clone(), *slots)
    with pytest.raises(ValueError, match=r"out needs q's shape \(2, 8, 128\)"):
        decode_fp8_mma_fwd(q, k, k, torch.zeros(2, 8, 64, dtype=bf16), *slots)
    with pytest.raises(ValueError, match=r"block_n=8; accepted: 16, 32"):
        decode_fp8_mma_fwd(q, k, k, q.clone(), *slots, block_n=8)
