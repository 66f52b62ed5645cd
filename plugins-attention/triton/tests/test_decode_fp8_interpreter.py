"""The fp8 tensor-core decode kernel (``decode_fp8``) against the float64 reference under Triton's
interpreter, where its fp8 dots run in float32 (exact on e4m3 operands), so what is checked is
the indexing, masking, splits, the two-term e4m3 query and P, and the transposed scores.

e4m3 pools at GQA groups 4 and 8 and head dims 64 and 128, rows of 1..150 tokens (blocks of 64
with partly masked last blocks) on shuffled slots, with and without splits, bf16 queries, outputs
poisoned with NaN first. The reference reads the same e4m3 values in float64 with the query
rounded to bf16, so the kernel differs from it only by its two-term query (~2^-8 of a row's
largest component), with ``fp8_mma`` 2 two-term P (~2^-8 of the largest probability), and with 1
and 3 P rounded to float16.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from engine_attention_triton import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (set where no GPU is present)")

from engine_attention_triton.decode_attention import decode_attention_fwd, fp8_mma_fits  # noqa: E402
from engine_attention_triton.interpreter_compat import patch_interpreter_index  # noqa: E402
from engine_attention_triton.jit_math import to_e4m3  # noqa: E402
from engine_attention_triton.reference import reference_decode  # noqa: E402


@triton.jit
def _round(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, to_e4m3(tl.load(x_ptr + offs), True))


def _run(group: int, kv_heads: int, head_dim: int, splits: int, fp8_mma: int, seed: int,
         q_mag: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    patch_interpreter_index()
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [1, 150, 64, 65]
    slots = sum(seq_lens) + 5
    k = torch.randn(slots, kv_heads, head_dim, generator=gen).to(torch.float8_e4m3fn)
    v = torch.randn(slots, kv_heads, head_dim, generator=gen).to(torch.float8_e4m3fn)
    req_to_token = torch.zeros(len(seq_lens) + 1, 160, dtype=torch.int32)
    order = torch.randperm(slots, generator=gen).to(torch.int32)
    rows = [3, 0, 4, 1]
    used = 0
    for row, n in zip(rows, seq_lens, strict=True):
        req_to_token[row, :n] = order[used : used + n]
        used += n
    q = (torch.randn(len(seq_lens), group * kv_heads, head_dim, generator=gen) * q_mag).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    part_out = torch.full((len(seq_lens), q.shape[1], splits + 1, head_dim), float("nan"))
    part_lse = torch.full((len(seq_lens), q.shape[1], splits + 1), float("nan"))
    scale = head_dim ** -0.5 / q_mag  # scores of the same spread whatever q's magnitude
    decode_attention_fwd(q, k, v, out, req_to_token, torch.tensor(rows), torch.tensor(seq_lens), part_out, part_lse,
                         splits, scale, fp8_mma=fp8_mma, k_scale=0.5, v_scale=2.0)
    ref = reference_decode(q.double(), k.double() * 0.5, v.double() * 2.0, req_to_token, rows, seq_lens, scale)
    return out, ref, q


@pytest.mark.parametrize("group,kv_heads,head_dim,splits,fp8_mma", [
    (4, 2, 128, 1, 1), (4, 2, 128, 3, 2), (8, 1, 64, 2, 1), (4, 2, 64, 1, 2), (4, 2, 128, 2, 3), (8, 1, 64, 1, 3),
])
def test_fp8_mma_matches_reference(group: int, kv_heads: int, head_dim: int, splits: int, fp8_mma: int) -> None:
    out, ref, _ = _run(group, kv_heads, head_dim, splits, fp8_mma, seed=head_dim + splits * 7 + fp8_mma)
    assert not torch.isnan(out).any(), "unwritten output"
    err = (out.double() - ref).abs().max().item()
    # |out| up to ~7: bf16 output rounding ~2.6e-3, plus the two-term query and P (measured ~4-5e-3).
    assert err < 1e-2, f"group={group} head_dim={head_dim} splits={splits} fp8_mma={fp8_mma}: max err {err:.3g}"


def test_two_term_query_keeps_large_and_small_rows() -> None:
    """Rows of |q| ~ 1e4 and ~1e-3 (scores of the usual spread): the per-row factor keeps both."""
    for mag in (3e4 / 64, 1e-3):
        out, ref, _ = _run(4, 2, 128, 2, 1, seed=5, q_mag=mag)
        err = (out.double() - ref).abs().max().item()
        assert err < 1e-2, f"q magnitude {mag}: max err {err:.3g}"


def test_emulated_e4m3_rounding_equals_torch() -> None:
    """The interpreter's stand-in for the fp8 conversion rounds as torch's float8_e4m3fn does
    (normal and subnormal values, both signs; ties excluded: the stand-in rounds them up)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=gen) * 100, torch.randn(4096, generator=gen) * 0.01,
                   torch.rand(8192, generator=gen) * 448 - 224])
    y = torch.empty_like(x)
    _round[(1,)](x, y, N=x.numel())
    assert torch.equal(y, x.to(torch.float8_e4m3fn).float())


def test_fp8_mma_refuses_what_it_cannot_attend() -> None:
    k = torch.zeros(4, 2, 128, dtype=torch.float8_e4m3fn)
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    assert fp8_mma_fits(q, k, k, 0.0, -1)
    assert not fp8_mma_fits(q, k, k, 30.0, -1)  # logit cap
    assert not fp8_mma_fits(q, k, k, 0.0, 128)  # sliding window
    assert not fp8_mma_fits(q.float(), k, k, 0.0, -1)
    assert not fp8_mma_fits(q, k.to(torch.bfloat16), k.to(torch.bfloat16), 0.0, -1)
    with pytest.raises(ValueError, match="fp8_mma=1 needs an e4m3 pool"):
        out = torch.empty(1, 8, 128, dtype=torch.bfloat16)
        decode_attention_fwd(q, k, k, out, torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                             torch.ones(1, dtype=torch.long), torch.empty(1, 8, 2, 128), torch.empty(1, 8, 2), 1,
                             1.0, logit_cap=30.0, fp8_mma=1)
