"""Simulated vendor devices for platform tests on a machine without the hardware.

Each ``simulate_*`` installs, through pytest's ``monkeypatch`` (undone when the test ends),
the part of the vendor's PyTorch surface a platform plugin probes: a HIP build of torch with
AMD GPUs behind ``torch.cuda``, Intel GPUs behind ``torch.xpu``, Ascend NPUs behind a
``torch_npu`` module that registers ``torch.npu`` when imported, or NVIDIA GPUs behind
``torch.cuda``. Nothing runs on a device: probes answer, and kernels are never launched.

The answers follow each vendor's documented API (``torch.cuda.get_device_properties(i)
.gcnArchName`` on ROCm, ``torch.xpu.mem_get_info``, ``torch.npu.mem_get_info``...), so a
platform that passes here asks the right questions; whether the real hardware answers them
the same way is what only a run on it shows (docs/platforms.md lists what ran where).

Usage (a third-party platform test)::

    from engine.testing import PlatformConformance
    from engine.testing.simulated_devices import simulate_npu

    class TestMyNpuPlatform(PlatformConformance):
        platform_name = "my-npu"

        @pytest.fixture(autouse=True)
        def simulated_device(self, monkeypatch):
            return simulate_npu(monkeypatch)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

GiB = 1 << 30


@dataclass
class SimulatedDevice:
    """What a simulation installed, and what the code under test did with it."""

    kind: str
    count: int
    total_bytes: int
    free_bytes: int
    name: str
    arch: str = ""
    #: device indices passed to ``set_device``.
    set_devices: list[int] = field(default_factory=list)
    synchronized: int = 0
    emptied: int = 0
    #: ``simulate_npu``: whether ``torch_npu`` has been imported.
    imported: bool = False


def _index(device: Any) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    return device.index if device.index is not None else 0


def _install_module_api(monkeypatch: Any, module: Any, sim: SimulatedDevice, props: Any) -> None:
    """The device-module calls platforms make (``torch.cuda``-style), answered from ``sim``."""

    def check(device: Any) -> int:
        index = _index(device)
        if not 0 <= index < sim.count:
            raise RuntimeError(f"simulated {sim.kind}: invalid device ordinal {index}")
        return index

    def set_device(device: Any) -> None:
        sim.set_devices.append(check(device))

    def synchronize(device: Any = None) -> None:
        sim.synchronized += 1

    def empty_cache() -> None:
        sim.emptied += 1

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        check(device)
        return sim.free_bytes, sim.total_bytes

    api = {
        "is_available": lambda: sim.count > 0,
        "device_count": lambda: sim.count,
        "current_device": lambda: sim.set_devices[-1] if sim.set_devices else 0,
        "set_device": set_device,
        "synchronize": synchronize,
        "empty_cache": empty_cache,
        "mem_get_info": mem_get_info,
        "get_device_properties": lambda device=None: props(check(device)),
        "get_device_name": lambda device=None: props(check(device)).name,
        "is_bf16_supported": lambda *a, **k: True,
        "is_initialized": lambda: True,
    }
    for name, fn in api.items():
        monkeypatch.setattr(module, name, fn, raising=False)


def _gpu_props(sim: SimulatedDevice, **extra: Any) -> Any:
    return lambda index: types.SimpleNamespace(name=sim.name, total_memory=sim.total_bytes, **extra)


def simulate_rocm(monkeypatch: Any, arch: str = "gfx942", count: int = 8, total_bytes: int = 192 * GiB,
                  free_bytes: int | None = None, name: str = "AMD Instinct MI300X",
                  hip_version: str = "6.4.43482") -> SimulatedDevice:
    """A ROCm build of torch (``torch.version.hip`` set) seeing ``count`` AMD GPUs of ``arch``
    (``gcnArchName`` as ROCm reports it, e.g. ``gfx942:sramecc+:xnack-``) through ``torch.cuda``."""
    sim = SimulatedDevice("rocm", count, total_bytes, total_bytes - GiB if free_bytes is None else free_bytes,
                          name, arch)
    monkeypatch.setattr(torch.version, "hip", hip_version)
    monkeypatch.setattr(torch.version, "cuda", None)
    # HIP reports gfx9 as major 9 (gfx942 -> (9, 4)); the platform must read gcnArchName instead.
    digits = arch[3:].split(":")[0]
    capability = (int(digits[:-2] or 0), int(digits[-2], 16)) if len(digits) >= 2 else (0, 0)
    props = _gpu_props(sim, gcnArchName=f"{arch}:sramecc+:xnack-", major=capability[0], minor=capability[1],
                       multi_processor_count=304)
    _install_module_api(monkeypatch, torch.cuda, sim, props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return sim


def simulate_cuda(monkeypatch: Any, capability: tuple[int, int] = (9, 0), count: int = 8,
                  total_bytes: int = 80 * GiB, free_bytes: int | None = None,
                  name: str = "NVIDIA H100 80GB HBM3") -> SimulatedDevice:
    """A CUDA build of torch seeing ``count`` NVIDIA GPUs of compute capability ``capability``."""
    sim = SimulatedDevice("cuda", count, total_bytes, total_bytes - GiB if free_bytes is None else free_bytes,
                          name, f"sm_{capability[0]}{capability[1]}")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    props = _gpu_props(sim, major=capability[0], minor=capability[1], multi_processor_count=132)
    _install_module_api(monkeypatch, torch.cuda, sim, props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return sim


def hide_cuda(monkeypatch: Any) -> None:
    """No CUDA/ROCm GPU visible (``torch.cuda.is_available()`` False): a machine of another vendor,
    even when the tests run on a GPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def simulate_xpu(monkeypatch: Any, count: int = 4, total_bytes: int = 64 * GiB, free_bytes: int | None = None,
                 name: str = "Intel(R) Data Center GPU Max 1550", alone: bool = True) -> SimulatedDevice:
    """``torch.xpu`` (PyTorch's built-in Intel GPU support) seeing ``count`` Intel GPUs; with
    ``alone`` (default) no CUDA GPU is visible either (``hide_cuda``)."""
    if alone:
        hide_cuda(monkeypatch)
    sim = SimulatedDevice("xpu", count, total_bytes, total_bytes - GiB if free_bytes is None else free_bytes, name)
    module = getattr(torch, "xpu", None)
    if module is None:  # a torch without XPU support at all: give it a module to answer from
        module = types.ModuleType("torch.xpu")
        monkeypatch.setattr(torch, "xpu", module, raising=False)
    _install_module_api(monkeypatch, module, sim, _gpu_props(sim, driver_version="1.6.32224"))
    return sim


class _FakeTorchNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch_npu``; importing it registers ``torch.npu`` (as Ascend's adapter does)."""

    def __init__(self, sim: SimulatedDevice, npu: types.ModuleType, monkeypatch: Any) -> None:
        self.sim, self.npu, self.monkeypatch = sim, npu, monkeypatch

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch_npu":
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        self.sim.imported = True
        # Like torch_npu: name PyTorch's out-of-tree device slot "npu" so torch.device("npu", i)
        # parses. Process-wide and not undoable (torch allows it once), harmless to CPU tests.
        if torch._C._get_privateuse1_backend_name() in ("privateuseone", "npu"):
            torch.utils.rename_privateuse1_backend("npu")
        module.__version__ = "2.6.0.post1"  # type: ignore[attr-defined]
        module.npu = self.npu  # type: ignore[attr-defined]
        self.monkeypatch.setattr(torch, "npu", self.npu, raising=False)


def simulate_npu(monkeypatch: Any, count: int = 8, total_bytes: int = 64 * GiB, free_bytes: int | None = None,
                 name: str = "Ascend910B2", alone: bool = True) -> SimulatedDevice:
    """An installed (not yet imported) ``torch_npu`` that, once imported, shows ``count`` Ascend NPUs
    as ``torch.npu``; ``SimulatedDevice.imported`` says whether anything imported it. With ``alone``
    (default) no CUDA GPU is visible either (``hide_cuda``)."""
    if alone:
        hide_cuda(monkeypatch)
    sim = SimulatedDevice("npu", count, total_bytes, total_bytes - GiB if free_bytes is None else free_bytes, name)
    npu = types.ModuleType("torch_npu.npu")
    _install_module_api(monkeypatch, npu, sim, _gpu_props(sim))
    finder = _FakeTorchNpuFinder(sim, npu, monkeypatch)
    # Absent before, absent after: setitem records "not set", so the undo deletes what the
    # simulated import leaves in sys.modules.
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    del sys.modules["torch_npu"]
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    if hasattr(torch, "npu"):
        monkeypatch.delattr(torch, "npu")
    return sim


def hide_module(monkeypatch: Any, name: str) -> None:
    """Makes ``import name`` (and ``importlib.util.find_spec(name)``) fail: the vendor library
    is not installed."""

    class _Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
            if fullname == name or fullname.startswith(name + "."):
                raise ModuleNotFoundError(f"No module named '{fullname}'", name=fullname)
            return None

    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    del sys.modules[name]
    monkeypatch.setattr(sys, "meta_path", [_Hide(), *sys.meta_path])


__all__ = ["GiB", "SimulatedDevice", "hide_cuda", "hide_module", "simulate_cuda", "simulate_npu", "simulate_rocm", "simulate_xpu"]
