"""The ``random`` schedule policy: a seeded shuffle of the waiting queue."""

from __future__ import annotations

from typing import Any

from engine.hookspecs import SchedulePolicySpec, hookimpl


@hookimpl
def register_schedule_policies(register):  # type: ignore[no-untyped-def]
    register(SchedulePolicySpec(name="random", factory="engine_policy_random.policy:RandomPolicy",
                                description="Seeded random order"))


def __getattr__(name: str) -> Any:
    # Registration stays cheap: the policy's module is imported when selected or named here
    # (``from engine_policy_random import RandomPolicy`` keeps working).
    if name in ("RandomPolicy",):
        from engine_policy_random import policy

        return getattr(policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
