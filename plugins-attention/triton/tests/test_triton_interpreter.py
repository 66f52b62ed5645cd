"""The conformance kit against the Triton backend on the CPU, under Triton's interpreter.

The root conftest sets ``TRITON_INTERPRET=1`` where no CUDA device is present; the plugin then
declares the cpu device too, and the same kernels run (slowly) in numpy. Checks correctness of
the kernels' indexing, masking and fp8-KV arithmetic in CI; speed is a GPU matter.
"""

from __future__ import annotations

import pytest
import torch
from engine_attention_triton import interpreting

from engine.testing import AttentionBackendConformance

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (set where no GPU is present)")


class TestTritonInterpreted(AttentionBackendConformance):
    backend_name = "triton"
    device = "cpu"
    # float32 only: Triton 3.6's interpreter computes 16-bit tl.dot wrongly (bf16 is tested on GPUs).
    dtypes = (torch.float32,)
    page_sizes = (1, 4)
