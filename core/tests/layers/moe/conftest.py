"""Fixtures of the MoE kernel tests: ``triton_device`` (each test runs where Triton can run it),
``triton_path`` (``FusedMoE``'s CUDA path on the CPU, under the interpreter) and
``replays_like_eager`` (a step captured in a CUDA graph, checked on fresh inputs).

``cuda`` (marked gpu) where a GPU is present; ``cpu`` under Triton's interpreter, which the root
conftest turns on (``TRITON_INTERPRET=1``) where none is. The same assertions check the compiled
kernels on the GPU and their logic on a CPU-only machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

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


@pytest.fixture
def replays_like_eager() -> Callable[..., None]:
    """``check(step, inputs, seeds)``: captures ``step()`` in a CUDA graph (after one eager call on a
    side stream, which compiles the kernels), then for each seed refills ``inputs`` in place with
    fresh Gaussian values, replays the graph, and asserts its output equals an eager ``step()``
    bit for bit: fixed shapes, no host syncs, nothing baked in at capture."""

    def check(step: Callable[[], torch.Tensor], inputs: list[torch.Tensor], seeds: tuple[int, ...]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for seed in seeds:
            gen = torch.Generator(device="cuda").manual_seed(seed)
            for tensor in inputs:
                tensor.copy_(torch.randn(tensor.shape, device="cuda", generator=gen).to(tensor.dtype))
            graph.replay()
            torch.testing.assert_close(out, step(), atol=0, rtol=0)

    return check
