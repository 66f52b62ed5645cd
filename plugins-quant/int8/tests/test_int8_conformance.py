"""The conformance kit for ``w8a8_int8`` (per-channel int8 weights, per-token int8 activations),
on the fly and from SGLang-layout checkpoints, on both paths of ``gemm.int8_linear``: the kit's
8-token batches take the weight-only path; the ``W8A8`` classes move the switch to 0.

Measured relative error ||y - y_ref|| / ||y_ref|| on the kit's random layers (float32, CPU):
W8A8 0.0086-0.0092, weight-only 0.0059-0.0067 (first shard of each test); the CUDA kernels
compute the same numbers up to float32 summation order. Bar: 0.02.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from engine.testing import QuantMethodConformance
from engine_quant_int8 import gemm
from engine_quant_int8.quantize import quantize_per_channel


class TestW8A8Int8Conformance(QuantMethodConformance):
    method_name = "w8a8_int8"
    max_rel_error = 0.02
    serialized_config: ClassVar[dict[str, Any] | None] = {"quant_method": "w8a8_int8"}

    def serialize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        # SGLang's layout: int8 weight [out, in] and float32 weight_scale [out, 1].
        q, scale = quantize_per_channel(weight)
        return {"weight": q, "weight_scale": scale[:, None]}


@pytest.mark.gpu
class TestW8A8Int8ConformanceCuda(TestW8A8Int8Conformance):
    device = "cuda"


@pytest.mark.gpu
class TestW8A8Int8ConformanceCudaBf16(TestW8A8Int8Conformance):
    device = "cuda"
    dtype = torch.bfloat16


class TestW8A8Int8ConformanceW8A8Path(TestW8A8Int8Conformance):
    @pytest.fixture(autouse=True)
    def _w8a8_path(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(gemm, "WEIGHT_ONLY_MAX_M", 0)


@pytest.mark.gpu
class TestW8A8Int8ConformanceW8A8PathCudaBf16(TestW8A8Int8ConformanceW8A8Path):
    device = "cuda"
    dtype = torch.bfloat16
