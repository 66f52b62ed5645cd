"""The CUDA fp8 GEMM path (``torch._scaled_mm``, above ``SCALED_MM_M`` tokens) against float64 maths
on the same fp8 operands.

Tolerances (||err|| / ||ref||) against the float64 product of the dequantized fp8
operands, which the GEMM reproduces up to accumulation and output rounding: 5e-3 for
float32 and float16 output (Hopper's fp8 tensor cores accumulate each k-tile with less
than float32 precision), 1e-2 for bfloat16. A wrong scale or layout gives errors of
order 1, so these still catch it. Against the unquantized float64 product: 0.1 (one
random token's error spreads up to ~0.077 over 200 seeds; the conformance kit holds
the 0.05 bar over 8 tokens).
"""

from __future__ import annotations

import pytest
import torch
from engine.layers.linear import QKVParallelLinear
from engine_quant_fp8 import gemm
from engine_quant_fp8.config import Fp8Config
from engine_quant_fp8.quantize import quantize_per_channel, quantize_per_tensor, quantize_per_token

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
GEMM_TOL = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}
MAX_REL_ERROR = 0.1
#: The smallest token count that takes torch._scaled_mm (fewer run the Triton kernels).
SCALED_MM_M = max(gemm.WEIGHT_ONLY_MAX_M, gemm.W8A8_TRITON_MAX_M) + 1


def _needs_fp8_gemm() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMM needs compute capability >= 8.9")


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.fixture
def scaled_mm_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts torch._scaled_mm calls, so a silent fallback to dequantization fails the test."""
    calls: list[int] = []
    real = torch._scaled_mm

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


def test_capability_gate_matches_the_device() -> None:
    q, _ = quantize_per_channel(torch.randn(32, 64, device=DEV))
    expected = torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)
    assert gemm.uses_fp8_gemm(torch.randn(SCALED_MM_M, 64, device=DEV), q) == expected
    assert not gemm.uses_fp8_gemm(torch.randn(SCALED_MM_M - 1, 64, device=DEV), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [SCALED_MM_M, SCALED_MM_M + 13, SCALED_MM_M + 200])
def test_scaled_mm_matches_dequantized_operands(dtype: torch.dtype, tokens: int, scaled_mm_calls: list[int]) -> None:
    _needs_fp8_gemm()
    torch.manual_seed(tokens)
    w = torch.randn(96, 128, device=DEV) * torch.logspace(-2, 1, 96, device=DEV)[:, None]
    qw, sw = quantize_per_channel(w)
    x = torch.randn(tokens, 128, device=DEV).to(dtype)
    bias = torch.randn(96, device=DEV).to(dtype)
    got = gemm.fp8_linear(x, qw, sw, bias)
    assert scaled_mm_calls and got.dtype == dtype and got.shape == (tokens, 96)
    qx, sx = quantize_per_token(x)
    exact = (qx.double() * sx.double()) @ (qw.double() * sw.double()[:, None]).t() + bias.double()
    assert _rel(got, exact) <= GEMM_TOL[dtype]
    assert _rel(got, x.double() @ w.double().t() + bias.double()) <= MAX_REL_ERROR


def test_static_input_scale_is_used(scaled_mm_calls: list[int]) -> None:
    _needs_fp8_gemm()
    torch.manual_seed(0)
    qw, sw = quantize_per_channel(torch.randn(64, 128, device=DEV))
    x = torch.randn(SCALED_MM_M + 8, 128, device=DEV)
    static = x.abs().max() / 448 * 2  # calibrated on a larger range than this batch
    got = gemm.fp8_linear(x, qw, sw, input_scale=static)
    qx, sx = quantize_per_token(x, static)
    exact = (qx.double() * sx.double()) @ (qw.double() * sw.double()[:, None]).t()
    assert scaled_mm_calls and _rel(got, exact) <= GEMM_TOL[torch.float32]


def test_unaligned_shapes_take_the_triton_gemm(scaled_mm_calls: list[int]) -> None:
    _needs_fp8_gemm()
    qw, sw = quantize_per_channel(torch.randn(24, 40, device=DEV))  # not multiples of 16
    x = torch.randn(SCALED_MM_M + 4, 40, device=DEV)
    got = gemm.fp8_linear(x, qw, sw)
    assert not scaled_mm_calls  # cuBLASLt refuses these shapes; the Triton fp8 x fp8 GEMM takes them
    qx, sx = quantize_per_token(x)
    exact = (qx.double() * sx.double()) @ (qw.double() * sw.double()[:, None]).t()
    assert _rel(got, exact) <= GEMM_TOL[torch.float32]


def test_fused_qkv_checkpoint_layer_on_cuda(scaled_mm_calls: list[int]) -> None:
    _needs_fp8_gemm()
    cfg = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
    gen = torch.Generator().manual_seed(0)
    shards = [quantize_per_tensor(torch.randn(n, 64, generator=gen) * m) for n, m in ((64, 0.1), (32, 1.0), (32, 10.0))]
    with torch.device(DEV):
        layer = QKVParallelLinear(64, 16, 4, 2, quant_config=cfg, prefix="model.layers.0.self_attn.qkv_proj")
    for shard_id, (q, s) in zip("qkv", shards, strict=True):
        layer.weight.weight_loader(layer.weight, q, shard_id)
        layer.weight_scale.weight_loader(layer.weight_scale, s, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(SCALED_MM_M + 5, 64, device=DEV)
    got = layer(x)
    assert scaled_mm_calls
    # Each shard keeps its own scale through the fused GEMM.
    w = torch.cat([q.double() * s.double() for q, s in shards]).to(DEV)
    qx, sx = quantize_per_token(x)
    assert _rel(got, (qx.double() * sx.double()) @ w.t()) <= GEMM_TOL[torch.float32]
