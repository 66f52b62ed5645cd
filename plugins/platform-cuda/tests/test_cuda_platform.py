"""The cuda platform: conformance kit everywhere, device probes on a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine import plugins
from engine.hookspecs import resolve_factory
from engine.testing import PlatformConformance

_HAS_GPU = torch.cuda.is_available() and torch.version.hip is None


def _platform():  # type: ignore[no-untyped-def]
    return resolve_factory(plugins.get_platform_spec("cuda").factory)()


class TestCudaPlatform(PlatformConformance):
    platform_name = "cuda"


def test_registered_as_a_claimant_not_a_fallback() -> None:
    spec = plugins.get_platform_spec("cuda")
    assert spec.device_type == "cuda" and not spec.fallback


def test_import_and_probe_do_not_initialise_cuda() -> None:
    # The registry constructs every platform and asks is_available() in every process.
    code = (
        "import torch, engine_platform_cuda\n"
        "from engine_platform_cuda.platform import CudaPlatform\n"
        "p = CudaPlatform(); p.is_available(); p.unavailable_reason(); p.default_attention_backend(('triton', 'flashinfer'))\n"
        "print(torch.cuda.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_reports_why_unavailable() -> None:
    platform = _platform()
    if platform.is_available():
        pytest.skip("a CUDA GPU is present")
    reason = platform.unavailable_reason()
    assert "torch" in reason and reason != "available"
    assert "unavailable" in platform.describe()


def test_default_attention_prefers_flashinfer_only_when_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_platform_cuda import platform as module

    platform = _platform()
    both = ("flashinfer", "torch_native", "triton")
    monkeypatch.setattr(module, "_flashinfer_importable", lambda: False)
    assert platform.default_attention_backend(both) == "triton"
    monkeypatch.setattr(module, "_flashinfer_importable", lambda: True)
    assert platform.default_attention_backend(both) == "flashinfer"
    # A disabled (or uninstalled) flashinfer is never the default, importable or not.
    assert platform.default_attention_backend(("torch_native", "triton")) == "triton"


def test_engine_tells_the_default_which_backends_are_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_platform_cuda import platform as module

    monkeypatch.setattr(module, "_flashinfer_importable", lambda: True)
    platform = _platform()
    if "flashinfer" in plugins.attention_backends():
        assert plugins.default_attention_backend(platform) == "flashinfer"
    assert plugins.default_attention_backend(platform, ["flashinfer"]) == "triton"


def test_policies() -> None:
    platform = _platform()
    assert platform.distributed_backend() == "nccl"
    assert platform.default_mem_fraction_static() == 0.88
    assert platform.supports_graph_capture() and platform.supports_overlap_schedule()
    assert platform.default_dtype() in (torch.bfloat16, torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_GPU, reason="needs a CUDA GPU")
def test_device_and_memory_probes() -> None:
    platform = _platform()
    assert platform.is_available()
    device = platform.device(0)
    assert device == torch.device("cuda", 0)
    platform.set_device(device)
    assert torch.cuda.current_device() == 0
    platform.empty_cache()  # so the allocation below cannot reuse a block cached by earlier tests
    free, total = platform.memory_info(device)
    assert 0 < free <= total
    # Allocating 256 MiB must show up in the driver's free-memory count.
    block = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    free_after, _ = platform.memory_info(device)
    assert free_after <= free - (200 << 20)
    del block
    platform.empty_cache()
    platform.synchronize()
    with pytest.raises(ValueError, match="local rank"):
        platform.device(torch.cuda.device_count())
    text = platform.describe()
    props = torch.cuda.get_device_properties(0)
    assert props.name in text and f"sm_{props.major}{props.minor}" in text
    assert platform.supports_dtype(torch.float16) and platform.supports_dtype(torch.float32)


# -- the available side on a simulated CUDA build (any machine) ------------------------------
from engine.testing.simulated_devices import simulate_cuda  # noqa: E402


class TestCudaSimulatedH100(PlatformConformance):
    platform_name = "cuda"

    @pytest.fixture(autouse=True)
    def simulated_device(self, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
        return simulate_cuda(monkeypatch, capability=(9, 0))


@pytest.mark.parametrize(("capability", "fp8"), [((9, 0), torch.float8_e4m3fn), ((8, 9), torch.float8_e4m3fn),
                                                 ((8, 0), None)])
def test_fp8_dtype_from_compute_capability(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                           fp8: torch.dtype | None) -> None:
    simulate_cuda(monkeypatch, capability=capability)
    platform = _platform()
    assert platform.fp8_dtype() == fp8
    assert platform.supports_dtype(torch.float8_e4m3fn) == (fp8 is not None)
    assert platform.unsupported_attention_reason("flashinfer") is None


def test_detected_alone_on_a_simulated_cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, count=2)
    spec, platform = plugins.choose_platform()
    assert spec.name == "cuda" and platform.device_count() == 2
    assert "NVIDIA H100" in platform.describe()


def test_spec_names_the_hardware_it_was_tested_on() -> None:
    assert "H100" in plugins.get_platform_spec("cuda").tested_on_hardware


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_GPU, reason="needs a CUDA GPU")
def test_stream_event_and_graph_methods_capture_and_replay() -> None:
    """What the graph runner and the overlapped decode now ask the platform for (issue 17, item 6)."""
    platform = _platform()
    device = platform.device(0)
    platform.set_device(device)
    x = torch.ones(1024, device=device)
    y = torch.empty_like(x)
    stream = platform.create_stream()
    with platform.stream_context(stream):
        torch.mul(x, 2, out=y)  # warm-up on the side stream
    stream.synchronize()
    graph = platform.create_graph()
    with platform.graph_capture(graph, None, stream):
        torch.mul(x, 3, out=y)
    x.fill_(2)
    graph.replay()
    event = platform.create_event()
    event.record()
    event.synchronize()
    assert torch.equal(y, torch.full_like(x, 6))
    assert graph.pool() is not None
    assert platform.pin_host_memory()
    assert platform.fp8_dtype() == (torch.float8_e4m3fn if torch.cuda.get_device_capability() >= (8, 9) else None)
