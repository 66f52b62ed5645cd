"""The ``fcfs`` schedule policy: requests run in arrival order (retracted ones keep theirs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.hookspecs import SchedulePolicySpec, hookimpl
from engine.managers.policy import PolicyContext, SchedulePolicy

if TYPE_CHECKING:
    from engine.managers.schedule_batch import Req


class FcfsPolicy(SchedulePolicy):
    def order(self, queue: list[Req], ctx: PolicyContext) -> list[Req]:
        return sorted(queue, key=lambda r: r.arrival_seq)


@hookimpl
def register_schedule_policies(register):  # type: ignore[no-untyped-def]
    register(SchedulePolicySpec(name="fcfs", factory=FcfsPolicy, description="First come, first served"))
