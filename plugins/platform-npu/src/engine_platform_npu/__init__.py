"""The ``npu`` platform plugin: Huawei Ascend NPUs through ``torch_npu`` (``torch.npu``).

Importing this module registers the platform only: ``torch_npu`` is imported when the
platform is probed (``is_available``) or selected, never at registration. Not run on Ascend
hardware yet: tested against a simulated ``torch_npu`` (``engine.testing.simulated_devices``).
"""

from __future__ import annotations

from engine.hookspecs import PlatformSpec, hookimpl


@hookimpl
def register_platforms(register):  # type: ignore[no-untyped-def]
    register(PlatformSpec(
        name="npu", factory="engine_platform_npu.platform:NpuPlatform", device_type="npu",
        description="Huawei Ascend NPUs via torch_npu (HCCL, torch_native attention, no fp8)",
        tested_on_hardware="",
    ))
