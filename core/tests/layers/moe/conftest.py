"""The ``triton_device`` fixture of the MoE kernel tests: each test runs where Triton can run it.

``cuda`` (marked gpu) where a GPU is present; ``cpu`` under Triton's interpreter, which the root
conftest turns on (``TRITON_INTERPRET=1``) where none is. The same assertions check the compiled
kernels on the GPU and their logic on a CPU-only machine.
"""

from __future__ import annotations

import os

import pytest
import torch


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(params=[
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(),
                                                 reason="triton runs on the CPU only under TRITON_INTERPRET=1")),
])
def triton_device(request: pytest.FixtureRequest) -> str:
    return str(request.param)
