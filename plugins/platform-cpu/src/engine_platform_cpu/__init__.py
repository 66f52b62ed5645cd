"""The ``cpu`` platform plugin: runs anywhere, chosen when no accelerator claims the machine."""

from __future__ import annotations

from engine.hookspecs import PlatformSpec, hookimpl


@hookimpl
def register_platforms(register):  # type: ignore[no-untyped-def]
    register(PlatformSpec(
        name="cpu", factory="engine_platform_cpu.platform:CpuPlatform", device_type="cpu",
        description="Any CPU via PyTorch; the fallback platform", fallback=True,
        tested_on_hardware="x86-64 (every test run)",
    ))
