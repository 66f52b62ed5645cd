"""The xpu platform against a simulated ``torch.xpu`` (no Intel GPU is reachable here):
detection, memory, dtype, backend, default attention, refusals."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import plugins
from engine.config import ServerArgs
from engine.errors import ConfigError, PluginError
from engine.selection import select_components
from engine.testing import PlatformConformance
from engine.testing.simulated_devices import GiB, simulate_rocm, simulate_xpu


def _platform() -> Any:
    return plugins.create(plugins.get_platform_spec("xpu").factory, options={})


def _hf_config() -> Any:
    return types.SimpleNamespace(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16", quantization_config=None)


class TestXpuSimulated(PlatformConformance):
    platform_name = "xpu"

    @pytest.fixture(autouse=True)
    def simulated_device(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        return simulate_xpu(monkeypatch)


class TestXpuOnThisMachine(PlatformConformance):
    platform_name = "xpu"


def test_unavailable_here_with_a_reason() -> None:
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        pytest.skip("an Intel GPU is present")
    platform = _platform()
    assert not platform.is_available() and platform.device_count() == 0
    assert "Intel GPU" in platform.unavailable_reason() or "no XPU support" in platform.unavailable_reason()


def test_detected_and_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_xpu(monkeypatch, count=4)
    spec, platform = plugins.choose_platform()
    assert spec.name == "xpu" and spec.device_type == "xpu" and platform.device_count() == 4
    assert plugins.choose_platform("xpu")[0].name == "xpu"


def test_two_claimants_are_never_both_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_xpu(monkeypatch)
    simulate_rocm(monkeypatch)
    with pytest.raises(PluginError, match=r"several platforms claim this machine \((rocm, xpu|xpu, rocm)\); choose one with --platform"):
        plugins.choose_platform()
    assert plugins.choose_platform("xpu")[0].name == "xpu"
    assert plugins.choose_platform("rocm")[0].name == "rocm"


def test_devices_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = simulate_xpu(monkeypatch, count=2, total_bytes=64 * GiB, free_bytes=60 * GiB)
    platform = _platform()
    device = platform.device(1)
    assert device == torch.device("xpu", 1)
    platform.set_device(device)
    assert sim.set_devices == [1]
    assert platform.memory_info(device) == (60 * GiB, 64 * GiB)  # torch.xpu.mem_get_info
    with pytest.raises(ValueError, match="local rank 5 has no XPU: 2 visible"):
        platform.device(5)
    platform.synchronize()
    platform.empty_cache()
    assert sim.synchronized == 1 and sim.emptied == 1
    assert "Intel(R) Data Center GPU Max 1550" in platform.describe()


def test_policies_and_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_xpu(monkeypatch)
    platform = _platform()
    assert platform.distributed_backend() == "xccl"
    assert not platform.supports_graph_capture() and not platform.supports_overlap_schedule()
    assert platform.fp8_dtype() is None
    assert platform.default_dtype() == torch.bfloat16 and platform.supports_dtype(torch.bfloat16)
    assert not platform.supports_dtype(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError):
        platform.create_graph()


def test_default_attention(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from engine_platform_xpu import platform as module

    simulate_xpu(monkeypatch)
    platform = _platform()
    everything = ("torch_native", "triton")
    assert platform.default_attention_backend(everything) == "torch_native"
    assert plugins.default_attention_backend(platform) == "torch_native"
    # Intel's Triton present, but the triton backend does not declare xpu (yet): still torch_native.
    monkeypatch.setattr(module, "intel_triton_present", lambda: True)
    assert platform.default_attention_backend(everything) == "torch_native"
    monkeypatch.setattr(module, "_triton_backend_runs_on_xpu", lambda: True)
    assert platform.default_attention_backend(everything) == "triton"
    assert platform.default_attention_backend(("torch_native",)) == "torch_native"


def test_intel_triton_is_found_on_disk_without_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.machinery

    from engine_platform_xpu import platform as module

    pkg = tmp_path / "triton"
    (pkg / "backends" / "nvidia").mkdir(parents=True)
    spec = importlib.machinery.ModuleSpec("triton", None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    monkeypatch.setattr(module.importlib.util, "find_spec", lambda name: spec if name == "triton" else None)
    assert not module.intel_triton_present()
    (pkg / "backends" / "intel").mkdir()
    assert module.intel_triton_present()


def test_quant_and_attention_for_other_devices_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_xpu(monkeypatch)
    if "fp8" not in plugins.quantization_methods():
        pytest.skip("fp8 not installed")
    with pytest.raises(ConfigError, match=r"quantization method 'fp8' does not run on platform 'xpu' \(runs on: cuda, cpu\)"):
        select_components(ServerArgs.from_dict({"platform": "xpu", "quant": "fp8"}), _hf_config())
    with pytest.raises(ConfigError, match=r"backend 'triton' does not run on xpu.*backends for platform 'xpu': torch_native"):
        select_components(ServerArgs.from_dict({"platform": "xpu", "attention": "triton"}), _hf_config())
    assert "never validated on Intel GPUs" in _platform().unsupported_quant_reason("fp8")
    selection = select_components(ServerArgs.from_dict({"platform": "xpu"}), _hf_config())
    assert selection.attention.name == "torch_native" and selection.quant is None
