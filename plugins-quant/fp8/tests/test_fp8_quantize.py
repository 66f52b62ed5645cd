"""FP8 quantize / dequantize maths and the CPU (dequantize + F.linear) path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_quant_fp8.gemm import fp8_linear, uses_fp8_gemm
from engine_quant_fp8.quantize import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_per_channel,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_per_token,
)


def _weight() -> torch.Tensor:
    torch.manual_seed(0)
    # Rows of very different magnitudes: per-channel scales must follow each row.
    return torch.randn(32, 64) * torch.logspace(-3, 2, 32)[:, None]


def test_per_channel_scale_maps_each_row_max_onto_448() -> None:
    w = _weight()
    q, scale = quantize_per_channel(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (32,)
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / FP8_MAX)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((32,), FP8_MAX))


def test_dequantize_error_is_within_half_an_e4m3_step() -> None:
    w = _weight()
    q, scale = quantize_per_channel(w)
    err = (dequantize_per_channel(q, scale, torch.float32) - w).abs()
    # e4m3 has 3 mantissa bits: half a step is 2**-4 of the value for normal numbers and
    # 2**-10 of the scale in the subnormal range; 1e-6 relative covers the float32 maths.
    bound = torch.maximum(w.abs() * 2**-4, scale[:, None] * 2**-10) * (1 + 1e-6)
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"


def test_zero_rows_and_tensors_quantize_to_zero_without_nan() -> None:
    w = torch.zeros(4, 16)
    q, scale = quantize_per_channel(w)
    assert torch.isfinite(scale).all() and not q.float().any()
    qt, st = quantize_per_tensor(w)
    assert torch.isfinite(st) and not qt.float().any()
    qx, sx = quantize_per_token(w)
    assert torch.isfinite(sx).all() and not qx.float().any()


def test_per_tensor_scale_is_the_tensor_max() -> None:
    w = _weight()
    q, scale = quantize_per_tensor(w)
    assert scale.shape == () and scale.item() == (w.abs().max() / FP8_MAX).item()
    assert q.float().abs().max().item() == FP8_MAX


def test_per_token_dynamic_and_static_scales() -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 64)
    q, scale = quantize_per_token(x)
    assert scale.shape == (5, 1)
    torch.testing.assert_close(scale, x.abs().amax(dim=1, keepdim=True) / FP8_MAX)
    # A static scale too small for the data saturates at +-448 instead of overflowing to NaN.
    q_static, s_static = quantize_per_token(x * 100, static_scale=torch.tensor(0.01))
    assert s_static.shape == (5, 1) and bool((s_static == 0.01).all())
    assert not q_static.float().isnan().any() and q_static.float().abs().max().item() == FP8_MAX


def test_cpu_path_is_dequantize_then_linear() -> None:
    q, scale = quantize_per_channel(_weight())
    x = torch.randn(3, 7, 64)
    bias = torch.randn(32)
    assert not uses_fp8_gemm(x, q)
    got = fp8_linear(x, q, scale, bias)
    assert got.shape == (3, 7, 32)
    torch.testing.assert_close(got, F.linear(x, dequantize_per_channel(q, scale, torch.float32), bias))


def test_cpu_path_keeps_the_activation_dtype() -> None:
    q, scale = quantize_per_channel(_weight())
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert fp8_linear(x, q, scale).dtype == torch.bfloat16


def test_scaled_mm_arguments_compute_the_fp8_product() -> None:
    # The CUDA path's exact call, run through torch's CPU _scaled_mm where this build has
    # one: checks the operand layout and the row-wise scale shapes without a GPU.
    from engine_quant_fp8.gemm import _scaled_mm_linear

    q, scale = quantize_per_channel(_weight())
    x = torch.randn(9, 64)
    try:
        got = _scaled_mm_linear(x, q, scale, None)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"no CPU torch._scaled_mm with row-wise scales here: {exc}")
    qx, x_scale = quantize_per_token(x)
    exact = (qx.double() * x_scale.double()) @ dequantize_per_channel(q, scale, torch.float64).t()
    assert ((got.double() - exact).norm() / exact.norm()).item() < 1e-5


def test_a_gpu_without_fp8_kernels_is_logged_once(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """An A100-class device (compute capability 8.0) takes the dequantize path, and says so once."""
    import logging

    from engine_quant_fp8 import gemm

    gemm._device_has_fp8_gemm.cache_clear()
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA A100")
    try:
        with caplog.at_level(logging.WARNING, logger="engine_quant_fp8.gemm"):
            assert gemm._device_has_fp8_gemm(0) is False
            assert gemm._device_has_fp8_gemm(0) is False
        warnings = [r for r in caplog.records if "no FP8 kernels" in r.getMessage()]
        assert len(warnings) == 1 and "A100" in warnings[0].getMessage()
    finally:
        gemm._device_has_fp8_gemm.cache_clear()


@pytest.mark.parametrize(("arch", "fast"), [("gfx942", False), ("gfx950", True)])
def test_the_fp8_gemm_follows_the_platforms_fp8_dtype(monkeypatch, arch: str, fast: bool) -> None:  # type: ignore[no-untyped-def]
    """On ROCm the kernels run only where the platform's fp8 type is the checkpoints' e4m3fn (gfx950);
    MI300's e4m3fnuz keeps the dequantize path (simulated HIP build, issue 17)."""
    from engine import plugins
    from engine.platforms import using_platform
    from engine.testing.simulated_devices import simulate_rocm

    from engine_quant_fp8 import gemm

    if "rocm" not in plugins.platforms():
        pytest.skip("plugserve-platform-rocm not installed")
    simulate_rocm(monkeypatch, arch=arch)
    rocm = plugins.create(plugins.get_platform_spec("rocm").factory, options={})
    gemm._device_has_fp8_gemm.cache_clear()
    try:
        with using_platform(rocm):
            assert gemm._device_has_fp8_gemm(0) is fast
        gemm._device_has_fp8_gemm.cache_clear()
        # Without the platform, a ROCm build is never assumed to have e4m3fn.
        assert gemm._device_has_fp8_gemm(0) is False
    finally:
        gemm._device_has_fp8_gemm.cache_clear()
