"""The rocm platform against a simulated HIP build of torch (no AMD GPU is reachable here):
detection, memory, fp8 dtype by architecture, backend, default attention, refusals."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from engine import plugins
from engine.config import ServerArgs
from engine.errors import ConfigError, PluginError
from engine.selection import select_components
from engine.testing import PlatformConformance
from engine.testing.simulated_devices import GiB, simulate_rocm


def _platform() -> Any:
    return plugins.create(plugins.get_platform_spec("rocm").factory, options={})


def _hf_config() -> Any:
    return types.SimpleNamespace(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16", quantization_config=None)


class TestRocmMI300(PlatformConformance):
    platform_name = "rocm"

    @pytest.fixture(autouse=True)
    def simulated_device(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        return simulate_rocm(monkeypatch, arch="gfx942")


class TestRocmMI350(PlatformConformance):
    platform_name = "rocm"

    @pytest.fixture(autouse=True)
    def simulated_device(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        return simulate_rocm(monkeypatch, arch="gfx950", name="AMD Instinct MI355X", total_bytes=288 * GiB)


class TestRocmOnThisMachine(PlatformConformance):
    """No simulation: on a CUDA or CPU build of torch the platform says why it is unavailable."""

    platform_name = "rocm"


def test_registered_as_a_cuda_device_type_claimant() -> None:
    spec = plugins.get_platform_spec("rocm")
    assert spec.device_type == "cuda" and not spec.fallback
    assert spec.tested_on_hardware == ""  # simulation only, and the listing says so


def test_not_a_rocm_build_is_the_reason_here() -> None:
    if torch.version.hip is not None:
        pytest.skip("a ROCm build of torch")
    platform = _platform()
    assert not platform.is_available() and platform.device_count() == 0
    assert "not a ROCm build" in platform.unavailable_reason()


def test_detected_alone_on_a_hip_build(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_rocm(monkeypatch, count=8)
    spec, platform = plugins.choose_platform()
    assert spec.name == "rocm" and platform.device_count() == 8
    # torch.cuda.is_available() is True on a HIP build: the cuda platform must not claim it too.
    cuda = plugins.create(plugins.get_platform_spec("cuda").factory, options={})
    assert not cuda.is_available() and "ROCm build" in cuda.unavailable_reason()
    assert plugins.choose_platform("rocm")[0].name == "rocm"
    with pytest.raises(PluginError, match="platform 'cuda' is not available.*ROCm build"):
        plugins.choose_platform("cuda")


def test_no_gpu_visible_on_a_hip_build(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_rocm(monkeypatch, count=0)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    platform = _platform()
    assert not platform.is_available()
    assert "no AMD GPU visible" in platform.unavailable_reason() and "HIP_VISIBLE_DEVICES" in platform.unavailable_reason()
    assert plugins.choose_platform()[0].name == "cpu"


def test_devices_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = simulate_rocm(monkeypatch, count=2, total_bytes=192 * GiB, free_bytes=150 * GiB)
    platform = _platform()
    device = platform.device(1)
    assert device == torch.device("cuda", 1)
    platform.set_device(device)
    assert sim.set_devices == [1]
    assert platform.memory_info(device) == (150 * GiB, 192 * GiB)
    with pytest.raises(ValueError, match="local rank 2 has no GPU: 2 visible.*HIP_VISIBLE_DEVICES"):
        platform.device(2)
    platform.synchronize()
    platform.empty_cache()
    assert sim.synchronized == 1 and sim.emptied == 1
    assert platform.default_mem_fraction_static() == 0.88
    text = platform.describe()
    assert "AMD Instinct MI300X" in text and "gfx942" in text and "HIP 6.4" in text


@pytest.mark.parametrize(("arch", "fp8"), [
    ("gfx942", torch.float8_e4m3fnuz),  # MI300X: the fnuz variant
    ("gfx950", torch.float8_e4m3fn),    # MI350X: OCP e4m3
    ("gfx1201", torch.float8_e4m3fn),   # RDNA4
    ("gfx90a", None),                   # MI250X: no fp8
])
def test_fp8_dtype_follows_the_architecture(monkeypatch: pytest.MonkeyPatch, arch: str, fp8: torch.dtype | None) -> None:
    simulate_rocm(monkeypatch, arch=arch)
    platform = _platform()
    assert platform.fp8_dtype() == fp8
    assert platform.fp8_dtype(torch.device("cuda", 3)) == fp8
    assert platform.supports_dtype(torch.float8_e4m3fn) == (fp8 == torch.float8_e4m3fn)
    assert platform.supports_dtype(torch.float8_e4m3fnuz) == (fp8 == torch.float8_e4m3fnuz)
    assert platform.supports_dtype(torch.bfloat16) and platform.default_dtype() == torch.bfloat16


def test_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_rocm(monkeypatch)
    platform = _platform()
    assert platform.distributed_backend() == "nccl"  # RCCL behind torch's nccl backend name
    assert platform.supports_graph_capture() and platform.supports_overlap_schedule()
    assert platform.pin_host_memory()


def test_default_attention_is_triton_never_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_rocm(monkeypatch)
    platform = _platform()
    assert platform.default_attention_backend(("flashinfer", "torch_native", "triton")) == "triton"
    assert platform.default_attention_backend(("flashinfer", "torch_native")) == "torch_native"
    assert plugins.default_attention_backend(platform) == "triton"


def test_flashinfer_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_rocm(monkeypatch)
    if "flashinfer" not in plugins.attention_backends():
        pytest.skip("plugserve-attention-flashinfer not installed")
    args = ServerArgs.from_dict({"platform": "rocm", "attention": "flashinfer"})
    with pytest.raises(ConfigError, match=r"--attention: platform 'rocm' cannot run attention backend 'flashinfer': "
                                          r"FlashInfer is built for NVIDIA GPUs only.*backends for platform 'rocm': .*triton"):
        select_components(args, _hf_config())


@pytest.mark.parametrize("method", ["gguf", "awq", "gptq"])
def test_quant_methods_with_ptx_kernels_are_refused(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    simulate_rocm(monkeypatch)
    if method not in plugins.quantization_methods():
        pytest.skip(f"{method} not installed")
    args = ServerArgs.from_dict({"platform": "rocm", "quant": method})
    with pytest.raises(ConfigError, match=rf"quantization method '{method}' does not run on platform 'rocm': "
                                          r"its Triton kernels embed NVIDIA PTX.*methods for platform 'rocm': .*fp8"):
        select_components(args, _hf_config())


def test_fp8_is_selectable_and_triton_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_rocm(monkeypatch)
    if "fp8" not in plugins.quantization_methods():
        pytest.skip("fp8 not installed")
    selection = select_components(ServerArgs.from_dict({"platform": "rocm", "quant": "fp8"}), _hf_config())
    assert selection.platform.name == "rocm" and selection.quant.name == "fp8"
    assert selection.attention.name == "triton"
