"""The ``lof`` schedule policy: the request that may generate the most tokens runs first."""

from __future__ import annotations

from typing import Any

from engine.hookspecs import SchedulePolicySpec, hookimpl


@hookimpl
def register_schedule_policies(register):  # type: ignore[no-untyped-def]
    register(SchedulePolicySpec(name="lof", factory="engine_policy_lof.policy:LofPolicy",
                                description="Longest output (max_new_tokens) first"))


def __getattr__(name: str) -> Any:
    # Registration stays cheap: the policy's module is imported when selected or named here
    # (``from engine_policy_lof import LofPolicy`` keeps working).
    if name in ("LofPolicy",):
        from engine_policy_lof import policy

        return getattr(policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
