"""The ``fcfs`` schedule policy: requests run in arrival order (retracted ones keep theirs)."""

from __future__ import annotations

from typing import Any

from engine.hookspecs import SchedulePolicySpec, hookimpl


@hookimpl
def register_schedule_policies(register):  # type: ignore[no-untyped-def]
    register(SchedulePolicySpec(name="fcfs", factory="engine_policy_fcfs.policy:FcfsPolicy",
                                description="First come, first served"))


def __getattr__(name: str) -> Any:
    # Registration stays cheap: the policy's module is imported when selected or named here
    # (``from engine_policy_fcfs import FcfsPolicy`` keeps working).
    if name in ("FcfsPolicy",):
        from engine_policy_fcfs import policy

        return getattr(policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
