"""The ``priority`` schedule policy: higher ``priority`` first, with optional preemption."""

from __future__ import annotations

from typing import Any

from engine.hookspecs import SchedulePolicySpec, hookimpl


@hookimpl
def register_schedule_policies(register):  # type: ignore[no-untyped-def]
    register(SchedulePolicySpec(name="priority", factory="engine_policy_priority.policy:PriorityPolicy",
                                description="Higher priority first, fcfs within a level; may preempt"))


def __getattr__(name: str) -> Any:
    # Registration stays cheap: the policy's module is imported when selected or named here
    # (``from engine_policy_priority import PriorityPolicy`` keeps working).
    if name in ("PriorityPolicy",):
        from engine_policy_priority import policy

        return getattr(policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
