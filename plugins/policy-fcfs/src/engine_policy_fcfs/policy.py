"""The ``fcfs`` schedule policy's implementation, imported when the policy is selected
(the package's ``__init__`` only registers it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.managers.policy import PolicyContext, SchedulePolicy

if TYPE_CHECKING:
    from engine.managers.schedule_batch import Req


class FcfsPolicy(SchedulePolicy):
    def order(self, queue: list[Req], ctx: PolicyContext) -> list[Req]:
        return sorted(queue, key=lambda r: r.arrival_seq)
