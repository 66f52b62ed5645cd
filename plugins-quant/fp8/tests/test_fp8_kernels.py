"""The Triton kernels against the dequantize + ``F.linear`` reference, on small shapes.

Without a CUDA device these run under Triton's interpreter (root conftest.py), so they check the
kernels' indexing, masking and scale placement; ``test_fp8_kernels_cuda.py`` repeats them at the
Llama-3-8B shapes on a GPU. With float32 activations the kernels compute what the reference does
up to summation order: measured max |err| / max |ref| about 3e-7, bar 1e-5 (a misplaced scale or
row gives errors of order 1). bfloat16 output is one rounding of that: bar 1e-2 relative (norm).
"""

from __future__ import annotations

import pytest
import torch
from engine_quant_fp8.gemm import reference_linear
from engine_quant_fp8.kernels import GEMV_MAX_M, quantize_per_token_triton, w8a16_linear
from engine_quant_fp8.quantize import (
    FP8_DTYPE,
    FP8_MAX,
    quantize_per_block,
    quantize_per_channel,
    quantize_per_token_reference,
)

# Small launch configs, so the interpreter runs several programs and K steps (and partial ones).
GEMV = {"kind": "gemv", "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4}
GEMM = {"kind": "gemm", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2, "num_warps": 4}


def _operands(m: int, n: int, k: int, block: tuple[int, int] | None, seed: int,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # Rows and columns of different magnitudes: a scale applied to the wrong row or K block shows.
    w = torch.randn(n, k, generator=gen) * torch.logspace(-1, 1, n)[:, None] * torch.logspace(1, -1, k)[None, :]
    q, s = quantize_per_block(w, block) if block else quantize_per_channel(w)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, q, s, bias


def _max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("config", [GEMV, GEMM], ids=["gemv", "gemm"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 200), (3, 48, 256), (7, 72, 136)])
@pytest.mark.parametrize("block", [None, (32, 64), (16, 32)], ids=["channel", "block32x64", "block16x32"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_weight_only_kernels_match_reference(config: dict, m: int, n: int, k: int,
                                             block: tuple[int, int] | None, with_bias: bool) -> None:
    x, q, s, bias = _operands(m, n, k, block, seed=m * n + k)
    b = bias if with_bias else None
    got = w8a16_linear(x, q, s, b, block, config)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert _max_rel(got, reference_linear(x, q, s, b, block)) < 1e-5


@pytest.mark.parametrize("m", [1, GEMV_MAX_M + 1, 19])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_default_configs_in_16_bit(m: int, dtype: torch.dtype) -> None:
    # The launch tables' own configs, 16-bit activations: output is one rounding of the float32 result.
    x, q, s, bias = _operands(m, 256, 512, None, seed=m, dtype=dtype)
    got = w8a16_linear(x, q, s, bias)
    ref = reference_linear(x.float(), q, s, bias.float())
    assert got.dtype == dtype
    assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_block_scales_with_the_real_block_and_partial_tiles() -> None:
    x, q, s, bias = _operands(5, 200, 320, (128, 128), seed=3)
    assert s.shape == (2, 3)
    for config in (GEMV, GEMM, None):
        got = w8a16_linear(x, q, s, bias, (128, 128), config)
        assert _max_rel(got, reference_linear(x, q, s, bias, (128, 128))) < 1e-5


@pytest.mark.parametrize("k", [320, 1000])
def test_gemv_steps_spanning_several_scale_columns(k: int) -> None:
    # BLOCK_K 512 covers 4 columns of 128-wide scales per step, the last step partly past K.
    x, q, s, bias = _operands(2, 24, k, (128, 128), seed=k)
    got = w8a16_linear(x, q, s, bias, (128, 128), {"kind": "gemv", "BLOCK_N": 8, "BLOCK_K": 512})
    assert _max_rel(got, reference_linear(x, q, s, bias, (128, 128))) < 1e-5


def test_non_contiguous_activations() -> None:
    x, q, s, _ = _operands(4, 32, 64, None, seed=4)
    wide = torch.cat([x, x], dim=1)[:, ::2]  # stride 2 along K
    assert _max_rel(w8a16_linear(wide, q, s, None, None, GEMV), reference_linear(wide, q, s)) < 1e-5


def _exactly_representable(m: int, k: int, seed: int) -> torch.Tensor:
    """Activations whose per-token quantization needs no rounding: fp8 codes times the row's scale,
    each row's max code 448. (Triton 3.6's interpreter rounds float32 -> e4m3 wrongly when the
    rounding carries into the exponent, which the GPU does right; the GPU test uses random data.)"""
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randn(m, k, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    codes[:, 0] = FP8_MAX
    return codes * torch.logspace(-3, 1, m)[:, None]


@pytest.mark.parametrize("k", [200, 4096 + 64])  # one partial block; more than one 4096-wide block
def test_quantize_per_token_kernel(k: int) -> None:
    x = _exactly_representable(6, k, seed=k)
    x[3] = 0.0  # an all-zero token: scale floors at 1e-12, codes 0
    q, scale = quantize_per_token_triton(x)
    q_ref, scale_ref = quantize_per_token_reference(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (6, 1)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_quantize_per_token_kernel_static_scale_clamps() -> None:
    x = _exactly_representable(3, 96, seed=1)
    static = torch.tensor(x.abs().max().item() / FP8_MAX / 4)  # 4x too small: most large values clamp to 448
    q, scale = quantize_per_token_triton(x, static)
    q_ref, scale_ref = quantize_per_token_reference(x, static)
    assert torch.equal(scale, scale_ref) and q.float().abs().max() == FP8_MAX
    # Clamped entries agree exactly; the rest may differ by the interpreter's rounding (see above).
    clamped = q_ref.float().abs() == FP8_MAX
    assert torch.equal(q.float()[clamped], q_ref.float()[clamped])
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0.07, atol=2**-9)


def test_quantize_per_token_kernel_static_scale_saturates_overflowing_quotients() -> None:
    """Under a static scale a value may exceed it by more than float32's range (or be infinite):
    its quotient is +-inf and clamps to +-448 as IEEE division's does (``kernels._div_rn`` keeps an
    infinite first product, which its correction would turn into NaN)."""
    x = torch.tensor([[float("inf"), -float("inf"), 3e38, -3e38, 1.0, -0.0, 2.0, 224.0]])
    q, _ = quantize_per_token_triton(x, torch.tensor(0.5))
    q_ref, _ = quantize_per_token_reference(x, torch.tensor(0.5))
    assert q.float().tolist() == q_ref.float().tolist() == [[448.0, -448.0, 448.0, -448.0, 2.0, -0.0, 4.0, 448.0]]


# ---- fp8 x fp8 (activations quantized too), for large M ------------------------------------------------


def _representable_groups(m: int, k: int, group: int, seed: int) -> torch.Tensor:
    """Activations whose per-token(-group) quantization is exact: codes times a power of two per
    token, each group's first code 448 (see ``_exactly_representable``)."""
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randn(m, k, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    codes[:, ::group] = FP8_MAX
    return codes * 2.0 ** torch.randint(-8, 3, (m, 1), generator=gen).float()


@pytest.mark.parametrize(("m", "n", "k", "block", "split_k"), [
    (5, 48, 200, None, 1), (40, 96, 256, None, 1), (9, 200, 320, (128, 128), 1), (33, 64, 96, (32, 32), 1),
    (40, 96, 256, None, 2), (7, 80, 512, None, 4),  # split-K: partial sums, then the reduce kernel
    (9, 200, 320, (128, 128), 2),  # block scales ignore SPLIT_K
])
def test_w8a8_gemm_matches_dequantized_operands(m: int, n: int, k: int, block: tuple[int, int] | None,
                                                split_k: int) -> None:
    from engine_quant_fp8.quantize import expand_block_scale
    from engine_quant_fp8.w8a8 import quantize_per_token_group_reference, w8a8_linear

    _, q, s, bias = _operands(m, n, k, block, seed=m + k)
    x = _representable_groups(m, k, block[1] if block else k, seed=m)
    got = w8a8_linear(x, q, s, bias, block, config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2,
                                                    "SPLIT_K": split_k})
    if block:
        qx, sx = quantize_per_token_group_reference(x, block[1])
        xd, wd = qx.float() * expand_block_scale(sx, (1, block[1]), m, k), q.float() * expand_block_scale(s, block, n, k)
    else:
        qx, sx = quantize_per_token_reference(x)
        xd, wd = qx.float() * sx, q.float() * s[:, None]
    assert _max_rel(got, xd @ wd.t() + bias) < 1e-5


def test_quantize_per_token_group_kernel() -> None:
    from engine_quant_fp8.w8a8 import quantize_per_token_group, quantize_per_token_group_reference

    x = _representable_groups(5, 200, 32, seed=2)  # 7 groups, the last one partial
    x[2] = 0.0
    q, s = quantize_per_token_group(x, 32)
    q_ref, s_ref = quantize_per_token_group_reference(x, 32)
    assert s.shape == (5, 7)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
