"""The ``dfs-weight`` schedule policy: requests sharing a cached prefix run together.

Waiting requests are grouped by the radix node their prompt's cached prefix ends at
(``req.last_node``). Every node on the way to the root is weighted by the number of
waiting requests in its subtree, and the queue is emitted by a depth-first walk that
visits heavier subtrees first. Requests below one node are therefore admitted
back to back, so the prefix they share stays hot (and locked) while they run, and
the biggest families go first.
"""

from __future__ import annotations

from typing import Any

from engine.hookspecs import SchedulePolicySpec, hookimpl


@hookimpl
def register_schedule_policies(register):  # type: ignore[no-untyped-def]
    register(SchedulePolicySpec(name="dfs-weight", factory="engine_policy_dfs_weight.policy:DfsWeightPolicy",
                                description="Depth-first over shared prefixes, largest groups first",
                                cache_aware=True))


def __getattr__(name: str) -> Any:
    # Registration stays cheap: the policy's module is imported when selected or named here
    # (``from engine_policy_dfs_weight import DfsWeightPolicy`` keeps working).
    if name in ("DfsWeightPolicy",):
        from engine_policy_dfs_weight import policy

        return getattr(policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
