"""``PlatformConformance``: a platform answers the whole platform contract (hook API 5).

Set ``platform_name``. On a machine without the device the kit checks that the platform
says so and why; to check the available side there, override the ``simulated_device``
fixture with one of ``engine.testing.simulated_devices`` (or your own fake of the vendor's
torch module)::

    class TestRocm(PlatformConformance):
        platform_name = "rocm"

        @pytest.fixture(autouse=True)
        def simulated_device(self, monkeypatch):
            return simulate_rocm(monkeypatch, arch="gfx942")

The contract: availability (and a reason when unavailable), device type and count, memory,
distributed backend, default attention backend (installed, enabled and not refused by the
platform itself), graph-capture support (with the graph methods where claimed), fp8 dtype
(a float8 dtype or None), the attention and quantization plugins it refuses (each with a
reason), the default activation dtype supported, and ``tested_on_hardware`` in the spec.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from engine import plugins
from engine.platforms import Platform

#: torch.distributed backends the engine knows a device type for (``placement_device_type``).
KNOWN_BACKENDS = ("nccl", "gloo", "xccl", "hccl")
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
                   if hasattr(torch, n))


class PlatformConformance:
    """Set ``platform_name``; override ``simulated_device`` to run the available side on a fake device."""

    platform_name: ClassVar[str] = ""
    #: whether the platform must be available in this run (True where ``simulated_device``
    #: installs a device: a simulation that leaves the platform unavailable is a failure).
    expect_available: ClassVar[bool | None] = None

    @pytest.fixture(autouse=True)
    def simulated_device(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        """Installs a simulated device; the default installs nothing (the real machine)."""
        return None

    def _platform(self) -> Platform:
        spec = plugins.get_platform_spec(self.platform_name)
        return plugins.create(spec.factory, options=plugins.declared_options("platform", spec.name))

    def _available(self, platform: Platform, simulated: Any) -> bool:
        available = platform.is_available()
        assert isinstance(available, bool)
        expected = self.expect_available if self.expect_available is not None else (True if simulated else None)
        if expected is not None:
            assert available == expected, (f"platform '{self.platform_name}' available={available}, expected {expected}: "
                                           f"{platform.unavailable_reason()}")
        return available

    def test_answers_probes(self, simulated_device: Any) -> None:
        spec = plugins.get_platform_spec(self.platform_name)
        platform = self._platform()
        available = self._available(platform, simulated_device)
        assert platform.name == spec.name
        assert platform.device_type == spec.device_type
        backend = platform.distributed_backend()
        assert isinstance(backend, str) and backend
        assert backend in KNOWN_BACKENDS, f"distributed backend {backend!r}: the engine knows {KNOWN_BACKENDS}"
        assert isinstance(platform.supports_graph_capture(), bool)
        assert isinstance(platform.supports_overlap_schedule(), bool)
        assert isinstance(getattr(spec, "tested_on_hardware", ""), str)
        assert isinstance(platform.describe(), str) and platform.describe()
        count = platform.device_count()
        assert isinstance(count, int) and count >= 0
        if not available:
            reason = platform.unavailable_reason()
            assert isinstance(reason, str) and reason and reason != "available"
            assert count == 0
            return
        assert count >= 1
        device = platform.device(0)
        assert device.type == platform.device_type
        free, total = platform.memory_info(device)
        assert isinstance(free, int) and isinstance(total, int)
        assert 0 <= free <= total and total > 0
        fraction = platform.default_mem_fraction_static()
        assert 0 < fraction <= 1

    def test_default_attention_backend_is_runnable_here(self, simulated_device: Any) -> None:
        platform = self._platform()
        self._available(platform, simulated_device)
        name = plugins.default_attention_backend(platform)
        assert name in plugins.attention_backends(), f"default attention backend '{name}' is not installed"
        assert platform.unsupported_attention_reason(name) is None, f"the platform refuses its own default '{name}'"
        spec = plugins.get_attention_backend(name)
        assert platform.device_type in spec.device_types, (
            f"default '{name}' does not declare device type '{platform.device_type}' (it lists {spec.device_types})")

    def test_refusals_carry_reasons(self, simulated_device: Any) -> None:
        platform = self._platform()
        self._available(platform, simulated_device)
        attention = plugins.attention_backends()
        quant = plugins.quantization_methods()
        for name in attention:
            reason = platform.unsupported_attention_reason(name)
            assert reason is None or (isinstance(reason, str) and reason), (name, reason)
        for name in quant:
            reason = platform.unsupported_quant_reason(name)
            assert reason is None or (isinstance(reason, str) and reason), (name, reason)
        assert set(platform.supported_attention_backends(attention)) <= set(attention)
        assert set(platform.supported_quant_methods(quant)) <= set(quant)

    def test_dtypes(self, simulated_device: Any) -> None:
        platform = self._platform()
        available = self._available(platform, simulated_device)
        fp8 = platform.fp8_dtype()
        assert fp8 is None or fp8 in FP8_DTYPES, f"fp8_dtype {fp8} is not a float8 dtype"
        assert isinstance(platform.default_dtype(), torch.dtype)
        if not available:
            assert fp8 is None, "an unavailable platform has no fp8 dtype to offer"
            return
        assert platform.supports_dtype(platform.default_dtype())
        assert platform.supports_dtype(torch.float32)
        if fp8 is not None:
            assert platform.supports_dtype(fp8), f"fp8_dtype {fp8} but supports_dtype({fp8}) is False"

    def test_graph_capture_claim_is_backed(self, simulated_device: Any) -> None:
        platform = self._platform()
        self._available(platform, simulated_device)
        overridden = type(platform).create_graph is not Platform.create_graph and \
            type(platform).graph_capture is not Platform.graph_capture
        if platform.supports_graph_capture():
            assert overridden, "supports_graph_capture() is True but create_graph/graph_capture are not implemented"
        else:
            with pytest.raises(NotImplementedError):
                platform.create_graph()
