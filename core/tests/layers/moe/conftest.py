"""Fixtures of the MoE kernel tests: ``triton_device`` (each test runs where Triton can run it)
and ``triton_path`` (``FusedMoE``'s CUDA path on the CPU, under the interpreter).

``cuda`` (marked gpu) where a GPU is present; ``cpu`` under Triton's interpreter, which the root
conftest turns on (``TRITON_INTERPRET=1``) where none is. The same assertions check the compiled
kernels on the GPU and their logic on a CPU-only machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

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


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, object]]]:
    """``FusedMoE`` on the CPU takes the path it takes on CUDA (one launch for routing and
    alignment, the fused kernel with those blocks), its kernels run by Triton's interpreter; the
    list records what ``fused_moe`` was given."""
    if not interpreting():
        pytest.skip("triton runs on the CPU only under TRITON_INTERPRET=1")
    import engine.layers.moe.fused_moe as fused_module
    import engine.layers.moe.layer as layer_module
    from engine.layers.moe.route_align_kernel import route_and_align_triton

    calls: list[tuple[str, object]] = []
    real = fused_module.fused_moe

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(("blocks", kwargs.get("blocks")))
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_module, "triton_available", lambda x: True)
    monkeypatch.setattr(layer_module, "route_and_align", route_and_align_triton)
    monkeypatch.setattr(fused_module, "fused_moe", recording)
    yield calls
