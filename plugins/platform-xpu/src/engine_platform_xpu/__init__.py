"""The ``xpu`` platform plugin: Intel GPUs through PyTorch's built-in XPU support (``torch.xpu``).

Importing this module registers the platform only. Not run on Intel hardware yet: tested
against a simulated ``torch.xpu`` (``engine.testing.simulated_devices.simulate_xpu``).
"""

from __future__ import annotations

from engine.hookspecs import PlatformSpec, hookimpl


@hookimpl
def register_platforms(register):  # type: ignore[no-untyped-def]
    register(PlatformSpec(
        name="xpu", factory="engine_platform_xpu.platform:XpuPlatform", device_type="xpu",
        description="Intel Data Center / Arc GPUs via torch.xpu (XCCL, torch_native attention, no graphs)",
        tested_on_hardware="",
    ))
