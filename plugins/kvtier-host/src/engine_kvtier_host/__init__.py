"""The ``host`` KV storage tier: evicted prefixes kept in host memory (pinned on CUDA).

Registration only; the tier is ``engine.mem_cache.kv_tier.HostMemoryTier`` in the core, which the
core's tests and the tier conformance kit use as their reference.
"""

from __future__ import annotations

from engine.hookspecs import KvStorageTierSpec, hookimpl


@hookimpl
def register_kv_storage_tiers(register):  # type: ignore[no-untyped-def]
    register(KvStorageTierSpec(
        name="host", factory="engine.mem_cache.kv_tier:HostMemoryTier",
        device_types=("cpu", "cuda", "rocm", "xpu", "npu"),
        description="Host memory, one row of all layers' K and V per slot (pinned when the pool is on a GPU)"))
