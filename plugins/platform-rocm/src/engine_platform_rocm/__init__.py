"""The ``rocm`` platform plugin: AMD GPUs through PyTorch's ROCm (HIP) build.

Importing this module registers the platform only; HIP is probed when the platform's
methods are called. Not run on AMD hardware yet: tested against a simulated HIP build
(``engine.testing.simulated_devices.simulate_rocm``).
"""

from __future__ import annotations

from engine.hookspecs import PlatformSpec, hookimpl


@hookimpl
def register_platforms(register):  # type: ignore[no-untyped-def]
    register(PlatformSpec(
        name="rocm", factory="engine_platform_rocm.platform:RocmPlatform", device_type="cuda",
        description="AMD Instinct/Radeon GPUs via PyTorch ROCm (RCCL, HIP graphs, triton attention)",
        tested_on_hardware="",
    ))
