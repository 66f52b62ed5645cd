"""The ``lpm`` schedule policy: the request with the longest cached prefix runs first."""

from __future__ import annotations

from typing import Any

from engine.hookspecs import SchedulePolicySpec, hookimpl


@hookimpl
def register_schedule_policies(register):  # type: ignore[no-untyped-def]
    register(SchedulePolicySpec(name="lpm", factory="engine_policy_lpm.policy:LpmPolicy",
                                description="Longest cached prefix first (fcfs past 128 waiting)",
                                cache_aware=True))


def __getattr__(name: str) -> Any:
    # Registration stays cheap: the policy's module is imported when selected or named here
    # (``from engine_policy_lpm import LpmPolicy`` keeps working).
    if name in ("FCFS_FALLBACK_QUEUE_LEN", "LpmPolicy"):
        from engine_policy_lpm import policy

        return getattr(policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
