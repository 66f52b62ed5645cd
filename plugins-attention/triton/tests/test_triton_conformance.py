"""The conformance kit against the Triton backend (GPU only)."""

from __future__ import annotations

import pytest
import torch

from engine.testing import AttentionBackendConformance

pytestmark = pytest.mark.gpu


class TestTritonConformance(AttentionBackendConformance):
    backend_name = "triton"
    device = "cuda"
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    page_sizes = (1, 16)
