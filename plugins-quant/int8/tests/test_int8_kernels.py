"""The Triton kernels against the torch references of their path, on small shapes.

Without a GPU the root conftest sets TRITON_INTERPRET=1, so the kernels run in Triton's
interpreter on the CPU; with one they run compiled. Odd token counts, K that no block divides
(200), bias, the K split and static activation scales are all covered.

Two limits of Triton 3.6's interpreter keep bfloat16 out of the kernel tests here (the GPU
tests in test_int8_cuda.py cover it): it rounds float32 -> bfloat16 by truncation, not to
nearest even, and its ``tl.dot`` multiplies bfloat16 operands as raw 16-bit integers.

Measured (interpreter, float32/float16): the W8A8 kernels equal ``w8a8_reference`` bit for bit
(same codes, same scales, exact int32 sums, same epilogue rounding); the weight-only kernels
differ from ``w8a16_reference`` only by the float32 summation order (<= 4e-7 relative, float32;
0 in float16 after rounding).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from engine_quant_int8 import gemm, kernels_w8a8, kernels_w8a16
from engine_quant_int8.quantize import quantize_per_channel, quantize_per_token

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 48, 200  # K = 200: no BLOCK_K divides it, so every kernel's K masks are exercised
K_SPLIT = 1100  # just long enough to split every kernel's K (the GEMV's in 2), and no BLOCK_K divides it
DTYPES = [torch.float32, torch.float16]


def _operands(tokens: int, dtype: torch.dtype, seed: int = 0, k: int = K) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, so per-channel scales matter.
    w = torch.randn(N, k, generator=gen) * torch.logspace(-2, 1, N)[:, None]
    qw, sw = quantize_per_channel(w)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    return tuple(t.to(DEVICE) for t in (x, qw, sw, bias))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("gemv", [True, False], ids=["gemv", "dot"])
@pytest.mark.parametrize("split", [False, True], ids=["whole-k", "split-k"])
def test_weight_only_kernels_match_reference(dtype: torch.dtype, tokens: int, gemv: bool, split: bool) -> None:
    k = K_SPLIT if split else K
    x, qw, sw, bias = _operands(tokens, dtype, k=k)
    # A huge SM count forces the K split (partials + reduce kernel); 1 SM never splits.
    sms = 10_000 if split else 1
    assert (kernels_w8a16.w8a16_config(tokens, N, k, gemv, sms, dtype)["SPLIT_K"] > 1) == split
    for b in (None, bias):
        got = kernels_w8a16.w8a16_linear_triton(x, qw, sw, b, gemv, sms)
        want = gemm.w8a16_reference(x, qw, sw, b)
        assert got.dtype == dtype and got.shape == (tokens, N)
        assert _rel(got, want) <= (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_quantize_kernel_equals_reference_codes_and_scales(dtype: torch.dtype, static: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 300, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0])[:, None]
    x[3] = 0  # an all-zero token: scale floors at 1e-12, codes 0
    # Exact ties: absmax 63.5 gives scale 0.5, and x = (k + 0.5) / 2 gives x / scale = k + 0.5,
    # so round-half-even decides every code of this token (the values are exact in bf16 too).
    x[4, :254] = (torch.arange(-127, 127) + 0.5) / 2
    x[4, 254] = 63.5
    x = x.to(dtype).to(DEVICE)
    input_scale = torch.tensor([0.0123], device=DEVICE) if static else None
    q, scale = kernels_w8a8.quantize_per_token(x, input_scale)
    q_ref, scale_ref = quantize_per_token(x, input_scale)
    assert torch.equal(q, q_ref)
    assert torch.equal(scale, scale_ref.reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_w8a8_kernels_equal_reference(dtype: torch.dtype, tokens: int, static: bool) -> None:
    x, qw, sw, bias = _operands(tokens, dtype, seed=tokens)
    input_scale = (x.float().abs().amax() / 100).reshape(1) if static else None  # some inputs clip
    for b in (None, bias):
        got = kernels_w8a8.w8a8_linear_triton(x, qw, sw, b, input_scale, gemm.num_sms(x.device))
        assert torch.equal(got, gemm.w8a8_reference(x, qw, sw, b, input_scale))


def test_w8a8_gemm_tiles_and_int32_range() -> None:
    # Extreme codes over a long K: sums reach 127 * 127 * 1024 (beyond float32's exact integers);
    # M and N not multiples of the tiles; several row tiles exercise the grouped tile order.
    gen = torch.Generator().manual_seed(2)
    qx = torch.randint(-127, 128, (130, 1024), dtype=torch.int8, generator=gen)
    qw = torch.randint(-127, 128, (136, 1024), dtype=torch.int8, generator=gen)
    qx[0], qw[0] = 127, 127
    ones_m, ones_n = torch.ones(130), torch.ones(136)
    got = kernels_w8a8.w8a8_gemm(*(t.to(DEVICE) for t in (qx, ones_m, qw, ones_n)), None, torch.float32, 1)
    want = (qx.double() @ qw.double().t()).float()
    assert torch.equal(got.cpu(), want)
    assert got[0, 0].item() == 127 * 127 * 1024


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_int_mm_variant_equals_reference(static: bool) -> None:
    x, qw, sw, bias = _operands(20, torch.float32)  # torch._int_mm: M > 16, K and N multiples of 8
    input_scale = torch.tensor([0.02], device=DEVICE) if static else None
    got = kernels_w8a8.w8a8_linear_int_mm(x, qw, sw, bias, input_scale)
    assert torch.equal(got, gemm.w8a8_reference(x, qw, sw, bias, input_scale))


@triton.jit
def _helpers_kernel(v_ptr, r_ptr, w_ptr, f_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(r_ptr + offs, kernels_w8a8._round_half_even(tl.load(v_ptr + offs)))
    tl.store(f_ptr + offs, kernels_w8a16._int8_to_f32(tl.load(w_ptr + offs)))


def test_rounding_and_int8_conversion_helpers() -> None:
    halves = torch.arange(-256, 256) / 2  # every tie in [-128, 128)
    near = torch.tensor([0.49999997, -0.49999997, 0.50000006, 126.49999, 1e-30, -1e-30])
    v = torch.cat([halves, near, torch.zeros(1024 - halves.numel() - near.numel())])
    w = torch.arange(-128, 128, dtype=torch.int8).repeat(4)
    r = torch.empty(1024, device=DEVICE)
    f = torch.empty(1024, device=DEVICE)
    _helpers_kernel[(1,)](v.to(DEVICE), r, w.to(DEVICE), f, BLOCK=1024)
    assert torch.equal(r.cpu(), torch.round(v))
    assert torch.equal(f.cpu(), w.float())


def test_int8_linear_switches_path_at_the_named_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    x, qw, sw, bias = _operands(6, torch.float32)
    monkeypatch.setattr(gemm, "WEIGHT_ONLY_MAX_M", 6)
    weight_only = gemm.int8_linear(x, qw, sw, bias)
    monkeypatch.setattr(gemm, "WEIGHT_ONLY_MAX_M", 5)
    w8a8 = gemm.int8_linear(x, qw, sw, bias)
    tol = 1e-6
    assert _rel(weight_only, gemm.w8a16_reference(x, qw, sw, bias)) <= tol
    assert _rel(w8a8, gemm.w8a8_reference(x, qw, sw, bias)) <= tol
    assert _rel(weight_only, w8a8) > tol  # the two paths are numerically different schemes
