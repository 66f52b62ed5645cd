"""The conformance kit for ``compressed-tensors`` pack-quantized weights (fused shards included).

Bar ``||y - y_ref|| / ||y_ref|| <= 0.12`` against float64 with the original weights (4-bit RTN:
about 0.08, the grid's step / sqrt(12)).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from engine.testing import QuantMethodConformance
from engine_quant_compressed_tensors.format import pack_compressed
from engine_quant_compressed_tensors.testing import int_config
from engine_quant_wna16.rtn import quantize_rtn


class TestCompressedTensorsW4A16Conformance(QuantMethodConformance):
    method_name = "compressed-tensors"
    max_rel_error = 0.12
    on_the_fly = False
    serialized_config: ClassVar[dict[str, Any] | None] = int_config(4, 64, False)

    def serialize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return pack_compressed(quantize_rtn(weight, 4, 64, symmetric=False, scale_dtype=torch.float32))
