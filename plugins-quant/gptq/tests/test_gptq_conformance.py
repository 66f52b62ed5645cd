"""The conformance kit for ``gptq``: the kit's random layers (fused q/k/v and gate/up included)
saved in GPTQ's layout and loaded back.

Bar ``||y - y_ref|| / ||y_ref|| <= 0.12`` against float64 with the original weights: 4-bit RTN in
groups of 32-128 measures 0.08-0.10 on CPU (the grid's step / sqrt(12)); 8-bit about 0.005.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from engine.testing import QuantMethodConformance
from engine_quant_gptq.format import pack_gptq
from engine_quant_wna16.rtn import act_order_g_idx, quantize_rtn

_HIDDEN = 128  # the kit's input width


class TestGptqConformance(QuantMethodConformance):
    method_name = "gptq"
    max_rel_error = 0.12
    on_the_fly = False
    serialized_config: ClassVar[dict[str, Any] | None] = {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False}

    def serialize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return pack_gptq(quantize_rtn(weight, 4, 32, symmetric=False))


class TestGptqActOrderConformance(TestGptqConformance):
    # One act-order per input width: the fused shards share it, as they share their input.
    serialized_config = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": True,
                         "checkpoint_format": "gptq_v2"}

    def serialize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        g_idx = act_order_g_idx(weight.shape[1], 64, seed=5)
        return pack_gptq(quantize_rtn(weight, 4, 64, symmetric=True, g_idx=g_idx), v2=True)


class TestGptq8BitConformance(TestGptqConformance):
    max_rel_error = 0.01
    serialized_config = {"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": False, "desc_act": False}

    def serialize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return pack_gptq(quantize_rtn(weight, 8, 128, symmetric=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestGptqActOrderConformanceCudaBf16(TestGptqActOrderConformance):
    device = "cuda"
    dtype = torch.bfloat16
