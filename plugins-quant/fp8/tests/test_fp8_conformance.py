"""The conformance kit's round trip for ``fp8`` (on-the-fly, per-channel weights).

Measured relative errors ||y - y_ref|| / ||y_ref|| on the kit's random 96x128 layer:
0.028 on CPU (weight-only: the weight is dequantized and activations stay exact). On the
CUDA fp8 GEMM path activations are also quantized to e4m3 (3 mantissa bits), so the
bar is 0.05 for both.
"""

from __future__ import annotations

import pytest
import torch
from engine.testing import QuantMethodConformance


class TestFp8Conformance(QuantMethodConformance):
    method_name = "fp8"
    max_rel_error = 0.05


@pytest.mark.gpu
class TestFp8ConformanceCuda(QuantMethodConformance):
    method_name = "fp8"
    device = "cuda"
    max_rel_error = 0.05


@pytest.mark.gpu
class TestFp8ConformanceCudaBf16(QuantMethodConformance):
    method_name = "fp8"
    device = "cuda"
    dtype = torch.bfloat16
    max_rel_error = 0.05
