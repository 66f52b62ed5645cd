"""Registration of the `numa` platform."""

from __future__ import annotations

from engine.hookspecs import PlatformSpec, hookimpl


@hookimpl
def register_platforms(register):  # type: ignore[no-untyped-def]
    register(PlatformSpec(
        name="numa",
        factory="engine_platform_numa.platform:NumaPlatform",
        device_type="cpu",
        description="CPU inference bound to one NUMA node of a multi-socket machine",
    ))
