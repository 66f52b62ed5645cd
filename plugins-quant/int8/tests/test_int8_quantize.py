"""int8 quantize / dequantize maths and the exact int32 emulation of the int8 GEMM."""

from __future__ import annotations

import pytest
import torch
from engine_quant_int8.gemm import int8_matmul, uses_int_mm, w8a8_linear
from engine_quant_int8.quantize import (
    INT8_MAX,
    dequantize_per_channel,
    quantize_per_channel,
    quantize_per_token,
)


def _weight() -> torch.Tensor:
    torch.manual_seed(0)
    # Rows of very different magnitudes: per-channel scales must follow each row.
    return torch.randn(32, 64) * torch.logspace(-3, 2, 32)[:, None]


def test_per_channel_codes_and_scales() -> None:
    w = _weight()
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (32,) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / INT8_MAX)
    # Each row's max hits +-127 and -128 never appears (symmetric grid).
    assert torch.equal(q.abs().amax(dim=1), torch.full((32,), 127, dtype=torch.int8))
    assert int(q.min()) >= -127


def test_dequantize_error_is_at_most_half_a_step() -> None:
    w = _weight()
    q, scale = quantize_per_channel(w)
    err = (dequantize_per_channel(q, scale) - w).abs()
    assert bool((err <= scale[:, None] * (0.5 + 1e-5)).all())


def test_per_token_scales_and_zero_rows() -> None:
    x = torch.randn(6, 64)
    x[2] = 0
    q, scale = quantize_per_token(x)
    assert scale.shape == (6, 1) and torch.isfinite(scale).all()
    assert not q[2].any()
    assert bool(((q.float() * scale - x).abs() <= scale * (0.5 + 1e-5)).all())


@pytest.mark.parametrize("rows", [1, 9, 40])
def test_emulated_int8_gemm_is_exact(rows: int) -> None:
    # Large K and extreme codes: the accumulator reaches ~6.6e7, beyond float32's exact range,
    # but the float64 emulation must still return the exact int32 sums.
    gen = torch.Generator().manual_seed(rows)
    qx = torch.randint(-127, 128, (rows, 4096), dtype=torch.int8, generator=gen)
    qx[0] = 127
    qw = torch.randint(-127, 128, (24, 4096), dtype=torch.int8, generator=gen)
    qw[0] = 127
    assert not uses_int_mm(qx, qw)
    acc = int8_matmul(qx, qw)
    assert acc.dtype == torch.int32
    assert torch.equal(acc, qx.to(torch.int32) @ qw.to(torch.int32).t())
    assert int(acc[0, 0]) == 127 * 127 * 4096


def test_emulation_matches_torch_int_mm_on_cpu() -> None:
    if not hasattr(torch, "_int_mm"):
        pytest.skip("this torch has no torch._int_mm")
    gen = torch.Generator().manual_seed(3)
    qx = torch.randint(-127, 128, (33, 256), dtype=torch.int8, generator=gen)
    qw = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=gen)
    try:
        expected = torch._int_mm(qx, qw.t())
    except RuntimeError as exc:  # older CPU builds have no kernel
        pytest.skip(f"torch._int_mm unavailable on CPU: {exc}")
    assert torch.equal(int8_matmul(qx, qw), expected)


def test_w8a8_linear_is_rescaled_int32_accumulator() -> None:
    q, scale = quantize_per_channel(_weight())
    x = torch.randn(3, 5, 64)
    bias = torch.randn(32)
    got = w8a8_linear(x, q, scale, bias)
    qx, x_scale = quantize_per_token(x.reshape(-1, 64))
    acc = qx.to(torch.int32) @ q.to(torch.int32).t()
    expected = (acc.float() * x_scale * scale[None, :]).reshape(3, 5, 32) + bias
    assert torch.equal(got, expected)


def test_w8a8_linear_keeps_the_activation_dtype() -> None:
    q, scale = quantize_per_channel(_weight())
    assert w8a8_linear(torch.randn(4, 64, dtype=torch.bfloat16), q, scale).dtype == torch.bfloat16


def test_static_input_scale_clips_and_repeats_per_token() -> None:
    x = torch.tensor([[0.5, -3.0, 0.26], [0.0, 10.0, -0.25]])
    q, scale = quantize_per_token(x, torch.tensor(0.02))
    assert scale.shape == (2, 1) and bool((scale == 0.02).all())
    # 0.26 / 0.02 = 13, 0.25 / 0.02 = 12.5 -> 12 (half to even); out-of-range values clip at +-127.
    assert q.tolist() == [[25, -127, 13], [0, 127, -12]]
