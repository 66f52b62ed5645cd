"""The ``fp8.fast_accum`` plugin option reaches ``torch._scaled_mm`` (CPU: the call is recorded).

``Fp8LinearMethod.apply`` passes the config's ``fast_accum`` to both fp8 x fp8 entry points: the
GEMM after a fused producer (``fp8_linear_quantized``) and the one that quantizes its own input
(``fp8_linear``'s ``torch._scaled_mm`` path, taken on CUDA sm89+ only: its device check is bypassed
here). The option's one default (``engine_quant_fp8.FAST_ACCUM``, also what ``gemm``'s callers without
the option get) and the engine's plugin-option plumbing are checked too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine.layers.quantization import QuantizedActivation
from engine_quant_fp8 import FAST_ACCUM, gemm
from engine_quant_fp8.config import Fp8Config
from engine_quant_fp8.method import Fp8LinearMethod
from engine_quant_fp8.quantize import FP8_DTYPE

M, N, K = 160, 64, 32  # M above W8A8_TRITON_MAX_M: the torch._scaled_mm path


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(N, K).to(FP8_DTYPE), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.rand(N) + 0.5, requires_grad=False)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    def fake(a: torch.Tensor, b: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append(kw)
        return torch.zeros(a.shape[0], b.shape[1], dtype=kw["out_dtype"])

    monkeypatch.setattr(torch, "_scaled_mm", fake)
    monkeypatch.setattr(gemm, "on_fp8_cuda", lambda x: True)
    return seen


@pytest.mark.parametrize("fast", [False, True])
def test_the_option_reaches_both_scaled_mm_calls(calls: list[dict[str, Any]], fast: bool) -> None:
    method = Fp8LinearMethod(Fp8Config.from_config({}, {"fast_accum": fast}))
    layer = _Layer()
    q = QuantizedActivation(torch.randn(M, K).to(FP8_DTYPE), torch.rand(M, 1), torch.bfloat16)
    assert method.apply(layer, q).shape == (M, N)
    assert method.apply(layer, torch.randn(M, K, dtype=torch.bfloat16)).shape == (M, N)
    assert [c["use_fast_accum"] for c in calls] == [fast, fast]


def test_callers_without_the_option_take_the_plugin_default(calls: list[dict[str, Any]]) -> None:
    layer = _Layer()
    x = torch.randn(M, K, dtype=torch.bfloat16)
    gemm.fp8_linear(x, layer.weight, layer.weight_scale)
    gemm.fp8_linear_quantized(QuantizedActivation(x.to(FP8_DTYPE), torch.rand(M, 1), torch.bfloat16),
                              layer.weight, layer.weight_scale)
    gemm.fp8_linear(x, layer.weight, layer.weight_scale, fast_accum=not FAST_ACCUM)
    assert [c["use_fast_accum"] for c in calls] == [FAST_ACCUM, FAST_ACCUM, not FAST_ACCUM]


def test_option_default_and_plumbing() -> None:
    from engine.plugins import check_plugin_options, get_registry

    assert FAST_ACCUM is True  # the documented default (README, docs/quantization.md)
    assert Fp8Config.from_config({}).fast_accum is FAST_ACCUM
    assert Fp8Config().fast_accum is FAST_ACCUM
    assert Fp8Config.from_config({"quant_method": "fp8"}, {"fast_accum": False}).fast_accum is False
    assert get_registry().options_for("fp8", {})["fast_accum"] is True
    assert get_registry().options_for("fp8", {"fp8": {"fast_accum": False}})["fast_accum"] is False
    check_plugin_options({"fp8": {"fast_accum": False}})  # declared: accepted
