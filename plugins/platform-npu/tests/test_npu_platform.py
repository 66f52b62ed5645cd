"""The npu platform against a simulated ``torch_npu`` (no Ascend NPU is reachable here):
lazy import, detection, memory, dtype, backend, default attention, refusals."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import pytest
import torch

from engine import plugins
from engine.config import ServerArgs
from engine.errors import ConfigError, PluginError
from engine.selection import select_components
from engine.testing import PlatformConformance
from engine.testing.simulated_devices import GiB, hide_module, simulate_npu


def _platform() -> Any:
    return plugins.create(plugins.get_platform_spec("npu").factory, options={})


def _hf_config() -> Any:
    return types.SimpleNamespace(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16", quantization_config=None)


class TestNpuSimulated(PlatformConformance):
    platform_name = "npu"

    @pytest.fixture(autouse=True)
    def simulated_device(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        return simulate_npu(monkeypatch)


class TestNpuWithoutTorchNpu(PlatformConformance):
    platform_name = "npu"

    @pytest.fixture(autouse=True)
    def simulated_device(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        hide_module(monkeypatch, "torch_npu")
        return None


def test_torch_npu_is_imported_only_when_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = simulate_npu(monkeypatch)
    import engine_platform_npu
    from engine_platform_npu.platform import NpuPlatform

    importlib.reload(engine_platform_npu)
    platform = NpuPlatform()
    plugins.get_platform_spec("npu")
    assert platform.device_type == "npu" and platform.distributed_backend() == "hccl"
    assert platform.default_attention_backend(("torch_native", "triton")) == "torch_native"
    assert not sim.imported and "torch_npu" not in sys.modules
    assert platform.is_available()
    assert sim.imported and "torch_npu" in sys.modules


def test_missing_vendor_library_is_a_reason_not_a_broken_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    hide_module(monkeypatch, "torch_npu")
    platform = _platform()
    assert not platform.is_available() and platform.device_count() == 0
    reason = platform.unavailable_reason()
    assert "vendor library torch_npu" in reason and "not installed" in reason
    info = next(p for p in plugins.list_plugins() if p.name == "npu")
    assert info.status == "ok"
    with pytest.raises(PluginError, match="platform 'npu' is not available on this machine: vendor library torch_npu"):
        plugins.choose_platform("npu")


def test_detected_and_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_npu(monkeypatch, count=8)
    spec, platform = plugins.choose_platform()
    assert spec.name == "npu" and platform.device_count() == 8


def test_no_npu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_npu(monkeypatch, count=0)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    platform = _platform()
    assert not platform.is_available()
    assert "no Ascend NPU visible" in platform.unavailable_reason()
    assert plugins.choose_platform()[0].name == "cpu"


def test_a_torch_npu_that_fails_to_import_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_platform_npu import platform as module

    sim = simulate_npu(monkeypatch)
    monkeypatch.setattr(module, "_npu", lambda: (_ for _ in ()).throw(ImportError("libhccl.so: cannot open shared object file\nmore")))
    platform = module.NpuPlatform()
    assert not platform.is_available()
    assert platform.unavailable_reason() == "import torch_npu failed: ImportError: libhccl.so: cannot open shared object file"
    assert not sim.imported


def test_devices_memory_and_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = simulate_npu(monkeypatch, count=2, total_bytes=64 * GiB, free_bytes=61 * GiB)
    platform = _platform()
    device = platform.device(1)
    assert device == torch.device("npu", 1)
    platform.set_device(device)
    assert sim.set_devices == [1]
    assert platform.memory_info(device) == (61 * GiB, 64 * GiB)
    with pytest.raises(ValueError, match="local rank 2 has no NPU: 2 visible"):
        platform.device(2)
    platform.synchronize()
    platform.empty_cache()
    assert sim.synchronized == 1 and sim.emptied == 1
    assert platform.fp8_dtype() is None and not platform.supports_dtype(torch.float8_e4m3fn)
    assert platform.default_dtype() == torch.bfloat16
    assert not platform.supports_graph_capture()
    assert "Ascend910B2" in platform.describe() and "torch_npu 2.6.0.post1" in platform.describe()


def test_fp8_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_npu(monkeypatch)
    assert _platform().unsupported_quant_reason("fp8") == "Ascend NPUs have no float8 arithmetic"
    if "fp8" not in plugins.quantization_methods():
        pytest.skip("fp8 not installed")
    with pytest.raises(ConfigError, match=r"quantization method 'fp8' does not run on platform 'npu'"):
        select_components(ServerArgs.from_dict({"platform": "npu", "quant": "fp8"}), _hf_config())
    selection = select_components(ServerArgs.from_dict({"platform": "npu"}), _hf_config())
    assert selection.attention.name == "torch_native" and selection.platform.name == "npu"
