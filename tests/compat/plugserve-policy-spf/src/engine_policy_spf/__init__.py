"""Registration of the `spf` schedule policy."""

from __future__ import annotations

from engine.hookspecs import SchedulePolicySpec, hookimpl


@hookimpl
def register_schedule_policies(register):  # type: ignore[no-untyped-def]
    register(SchedulePolicySpec(
        name="spf",
        factory="engine_policy_spf.policy:ShortestPromptFirst",
        description="fewest tokens left to prefill first (cached prefix deducted); ties by arrival",
        cache_aware=True,
    ))
