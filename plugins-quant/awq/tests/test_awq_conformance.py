"""The conformance kit for ``awq``: AutoAWQ GEMM checkpoints of the kit's random layers.

The kit's bar is ``||y - y_ref|| / ||y_ref||`` against float64 with the original weights; 4-bit
round-to-nearest in groups of 32 measures about 0.08 on CPU (float32: the 4-bit grid's
step / sqrt(12) over a group's range), and the bar is 0.12.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from engine.testing import QuantMethodConformance
from engine_quant_awq.format import pack_awq
from engine_quant_wna16.rtn import quantize_rtn


class TestAwqConformance(QuantMethodConformance):
    method_name = "awq"
    max_rel_error = 0.12
    on_the_fly = False
    serialized_config: ClassVar[dict[str, Any] | None] = {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}

    def serialize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return pack_awq(quantize_rtn(weight, 4, 32, symmetric=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestAwqConformanceCudaBf16(TestAwqConformance):
    device = "cuda"
    dtype = torch.bfloat16
