"""The fused MLA prologue (``mla_prologue``) against the model's torch path, under Triton's
interpreter on the CPU (or compiled on a GPU).

Tiny shapes: 3 heads (not a power of two), nope 8, latent 24 (padded to 32), rope 8; positions and
pool slots shuffled; both rope layouts; a 16-bit pool and an fp8 one with a scale and a value past
the format's range. The outputs and the pool are filled with NaN first, so an unwritten value fails.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from engine.layers.layernorm import RMSNorm
from engine.mem_cache.memory_pool import quantize_kv
from engine_models_deepseek.rope import DeepseekRotaryEmbedding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="triton runs on the CPU only under TRITON_INTERPRET=1")

HEADS, NOPE, LORA, ROPE = 3, 8, 24, 8


def _config(interleave: bool) -> SimpleNamespace:
    return SimpleNamespace(qk_rope_head_dim=ROPE, rope_theta=10000.0, max_position_embeddings=64,
                           rope_interleave=interleave, rope_scaling=None, rope_parameters=None)


@pytest.mark.parametrize("absorb", [False, True], ids=["apart", "with_w_uk"])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("pool_dtype, k_scale", [(None, 1.0), (torch.float8_e4m3fn, 0.37)])
def test_prologue_matches_torch(interleave: bool, pool_dtype: torch.dtype | None, k_scale: float,
                                absorb: bool) -> None:
    """``with_w_uk``: the W_UK product's programs in the same launch (3 tokens, the decode sizes
    it takes) also fill the query rows' latent part, as the batched GEMM would."""
    from engine_models_deepseek.mla_prologue import mla_prologue

    dtype = torch.float16 if DEV == "cpu" else torch.bfloat16  # the interpreter's bf16 is not faithful
    gen = torch.Generator().manual_seed(7 + interleave)
    tokens = 3 if absorb else 5
    q = (torch.randn(tokens, HEADS, NOPE + ROPE, generator=gen) * 2).to(dtype)
    kv_a = (torch.randn(tokens, LORA + ROPE + 3, generator=gen) * 2).to(dtype)[:, :LORA + ROPE]  # row stride != width
    kv_a[1, LORA] = 600.0  # past e4m3's 448 once divided by the scale: saturates
    positions = torch.randperm(60, generator=gen)[:tokens]
    norm = RMSNorm(LORA, 1e-6)
    norm.weight.data = (torch.rand(LORA, generator=gen) + 0.5).to(dtype)
    rotary = DeepseekRotaryEmbedding(_config(interleave))

    # The model's torch path (DeepseekMLA._attend's steps).
    c_ref = norm(kv_a[:, :LORA].contiguous())
    q_pe, k_pe = rotary(positions, q[..., NOPE:], kv_a[:, LORA:].reshape(tokens, 1, ROPE))
    k_ref = torch.cat((c_ref, k_pe.view(tokens, ROPE)), dim=-1)

    pool_dtype = pool_dtype or dtype
    slots = torch.randperm(20, generator=gen)[:tokens]
    pool = torch.full((20, 1, LORA + ROPE), float("nan"), dtype=torch.float32).to(pool_dtype)
    q_out = torch.full((tokens, HEADS, LORA + ROPE), float("nan"), dtype=dtype)
    k_out = torch.full((tokens, LORA + ROPE), float("nan"), dtype=dtype)
    args = [t.to(DEV) for t in (q, kv_a, positions, rotary.cos_cache, rotary.sin_cache, norm.weight.data)]
    q_dev, k_dev, pool_dev = q_out.to(DEV), k_out.to(DEV), pool.to(DEV)
    w_uk = (torch.randn(HEADS, NOPE, LORA, generator=gen) * 0.1).to(dtype) if absorb else None
    mla_prologue(*args, 1e-6, NOPE, interleave, q_dev, k_dev, pool_dev, slots.to(DEV), k_scale,
                 w_uk=w_uk.to(DEV) if absorb else None)

    # Rounding may differ by one unit of the 16-bit dtype (fused multiply-adds, rsqrt).
    tol = dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(k_dev.cpu(), k_ref, **tol)
    torch.testing.assert_close(q_dev[..., LORA:].cpu(), q_pe, **tol)
    if absorb:
        q_lat = torch.bmm(q[..., :NOPE].float().transpose(0, 1), w_uk.float()).transpose(0, 1)
        torch.testing.assert_close(q_dev[..., :LORA].float().cpu(), q_lat, **tol)
    else:
        assert torch.isnan(q_dev[..., :LORA].float()).all(), "the latent part of q is the bmm's, not the prologue's"
    stored = pool_dev.cpu()[slots, 0].float()
    expected = quantize_kv(k_ref, pool_dtype, k_scale).float()
    if pool_dtype.itemsize == 1:
        assert stored[1, LORA:].abs().max() == torch.finfo(pool_dtype).max  # saturated, not NaN
        checked = torch.ones_like(stored, dtype=torch.bool)
        if DEV == "cpu":
            # The interpreter's e4m3 conversion drops the carry of a mantissa rounding up to the next
            # power of two (-7.83 -> -4.0); the compiled one rounds to nearest even.
            checked = expected.abs().log2() != expected.abs().log2().round()
        # One e4m3 step where a 16-bit rounding difference crosses a rounding boundary.
        torch.testing.assert_close(stored[checked], expected[checked], atol=0.07, rtol=0.13)
    else:
        torch.testing.assert_close(stored, expected, **tol)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(pool_dev.cpu()[untouched].float()).all(), "a slot outside out_loc was written"


def test_rejects_odd_rope() -> None:
    from engine_models_deepseek.mla_prologue import mla_prologue

    q = torch.zeros(1, 2, 11, device=DEV)
    kv = torch.zeros(1, 19, device=DEV)
    with pytest.raises(ValueError, match="even rope dim"):
        mla_prologue(q, kv, torch.zeros(1, dtype=torch.long, device=DEV), torch.zeros(4, 2, device=DEV),
                     torch.zeros(4, 2, device=DEV), torch.ones(16, device=DEV), 1e-6, 8, True,
                     torch.zeros(1, 2, 19, device=DEV), torch.zeros(1, 19, device=DEV))


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_gate_kernel_matches_float32_linear(tokens: int) -> None:
    """The router's one-launch float32 logits equal ``F.linear(x.float(), weight)`` (the CPU
    path) up to summation order; 11 experts (not a multiple of the kernel's 2-row blocks) and 600
    hidden (not a multiple of its 512-wide steps)."""
    from engine_models_deepseek.gate_kernel import MAX_TOKENS, gate_logits
    from engine_models_deepseek.models import GATE_KERNEL_MAX_TOKENS

    assert GATE_KERNEL_MAX_TOKENS == MAX_TOKENS
    gen = torch.Generator().manual_seed(tokens)
    dtype = torch.float16 if DEV == "cpu" else torch.bfloat16
    x = torch.randn(tokens, 600, generator=gen).to(dtype)
    weight = torch.randn(11, 600, generator=gen) * 0.05
    out = gate_logits(x.to(DEV), weight.to(DEV))
    assert out.dtype == torch.float32 and out.shape == (tokens, 11)
    torch.testing.assert_close(out.cpu(), torch.nn.functional.linear(x.float(), weight), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("transposed", [False, True], ids=["w_uk", "w_uv"])
def test_head_matvec_matches_bmm(tokens: int, transposed: bool) -> None:
    """The per-head products (``q_nope @ W_UK[h]``; the output's ``@ W_UV[h].T``) equal the model's
    batched matmul, reading a strided x (a slice of wider rows) and writing a strided destination
    (the latent part of query rows) and nothing else; 3 heads, K 40 and N 24 (no tile divides them)."""
    from engine_models_deepseek.head_matvec import MAX_TOKENS, head_matvec

    assert tokens <= MAX_TOKENS
    gen = torch.Generator().manual_seed(tokens + 10 * transposed)
    dtype = torch.float16 if DEV == "cpu" else torch.bfloat16
    k, n = 40, 24
    rows = torch.randn(tokens, HEADS, k + 8, generator=gen).to(dtype)
    x = rows[..., 8:]  # strided along tokens and heads
    w = (torch.randn(HEADS, n, k, generator=gen) if transposed else torch.randn(HEADS, k, n, generator=gen)) * 0.1
    w = w.to(dtype)
    dest = torch.full((tokens, HEADS, n + 5), float("nan"), dtype=dtype)
    dest_dev = dest.to(DEV)
    head_matvec(x.to(DEV), w.to(DEV), dest_dev[..., :n], transposed=transposed)
    ref = torch.bmm(x.float().transpose(0, 1), (w.transpose(1, 2) if transposed else w).float()).transpose(0, 1)
    torch.testing.assert_close(dest_dev[..., :n].float().cpu(), ref, atol=2e-2, rtol=2e-2)
    assert dest_dev[..., n:].isnan().all()
    with pytest.raises(ValueError, match="head_matvec: .*accepted"):
        head_matvec(x.to(DEV), w.to(DEV), dest_dev[..., :n - 1], transposed=transposed)


@pytest.mark.parametrize("residual", [True, False])
def test_gate_kernel_takes_the_rmsnorm_before_it(residual: bool) -> None:
    """With a ``PendingNorm`` the one launch computes the post-attention RMSNorm too: its logits are
    the gate of ``RMSNorm(x, residual)``'s output, and it fills the norm output and ``x + residual``
    as ``RMSNorm`` computes them (same roundings; 1 token, hidden 600: no tile divides it)."""
    from engine.layers.layernorm import PendingNorm, RMSNorm
    from engine_models_deepseek.gate_kernel import gate_logits

    gen = torch.Generator().manual_seed(40 + residual)
    dtype = torch.float16 if DEV == "cpu" else torch.bfloat16
    x = torch.randn(1, 600, generator=gen).to(dtype).to(DEV)
    res = torch.randn(1, 600, generator=gen).to(dtype).to(DEV) if residual else None
    norm = RMSNorm(600, 1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_((torch.rand(600, generator=gen) + 0.5).to(norm.weight.dtype))
    norm = norm.to(dtype)
    weight = (torch.randn(11, 600, generator=gen) * 0.05).to(DEV)
    normed = torch.full_like(x, float("nan"))
    res_sum = torch.full_like(x, float("nan")) if residual else x
    out = gate_logits(PendingNorm(x, res, norm.weight, 1e-6, normed, res_sum), weight)
    ref_sum = (x.float() + res.float()).to(dtype) if residual else x
    ref_normed = norm._norm(ref_sum)
    torch.testing.assert_close(normed.float().cpu(), ref_normed.float().cpu(), atol=2e-3, rtol=2e-3)
    if residual:
        torch.testing.assert_close(res_sum.cpu(), ref_sum.cpu(), atol=0, rtol=0)
    ref = torch.nn.functional.linear(ref_normed.float(), weight)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)

