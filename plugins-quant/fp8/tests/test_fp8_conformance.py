"""The conformance kit for ``fp8``: on-the-fly per-channel weights and AutoFP8-style checkpoints.

Measured relative errors ||y - y_ref|| / ||y_ref|| on the kit's random layers: 0.028 on CPU
(weight-only: the weight is dequantized and activations stay exact). On the CUDA fp8 GEMM
path activations are also quantized to e4m3 (3 mantissa bits), so the bar is 0.05 for both.
A serialized checkpoint stores one per-tensor scale per projection (coarser than on the fly's
per-channel ones); the kit's shards are each of one magnitude, so the same bar holds.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from engine.testing import QuantMethodConformance
from engine_quant_fp8.quantize import quantize_per_tensor


class TestFp8Conformance(QuantMethodConformance):
    method_name = "fp8"
    max_rel_error = 0.05
    serialized_config: ClassVar[dict[str, Any] | None] = {"quant_method": "fp8", "activation_scheme": "dynamic"}

    def serialize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        # AutoFP8's layout: float8_e4m3fn weight and a 0-d float32 weight_scale per projection.
        q, scale = quantize_per_tensor(weight)
        return {"weight": q, "weight_scale": scale}


class TestFp8StaticConformance(TestFp8Conformance):
    # Static activation scales: the checkpoint adds a 0-d input_scale per projection.
    serialized_config = {"quant_method": "fp8", "activation_scheme": "static"}

    def serialize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        # The kit's activations are standard normal: |x| < 6 with overwhelming odds, 448 is e4m3's max.
        return {**super().serialize_weight(weight), "input_scale": torch.tensor(6.0 / 448.0)}


@pytest.mark.gpu
class TestFp8ConformanceCuda(TestFp8Conformance):
    device = "cuda"


@pytest.mark.gpu
class TestFp8StaticConformanceCuda(TestFp8StaticConformance):
    device = "cuda"


@pytest.mark.gpu
class TestFp8ConformanceCudaBf16(TestFp8Conformance):
    device = "cuda"
    dtype = torch.bfloat16
