"""The conformance kit against the FlashInfer backend (GPU with flashinfer installed only)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.testing import AttentionBackendConformance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="needs flashinfer (pip install plugserve-attention-flashinfer[flashinfer])"),
]


class TestFlashInferConformance(AttentionBackendConformance):
    backend_name = "flashinfer"
    device = "cuda"
    dtypes = (torch.bfloat16, torch.float16)
    page_sizes = (1, 16)
    # FlashInfer instantiates its kernels for head dims 64, 128, 256 (and 512 in some
    # paths); the kit's default of 32 is not among them.
    head_dim = 64
