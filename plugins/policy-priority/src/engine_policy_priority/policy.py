"""The ``priority`` schedule policy's implementation, imported when the policy is selected
(the package's ``__init__`` only registers it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.managers.policy import PolicyContext, SchedulePolicy

if TYPE_CHECKING:
    from engine.managers.schedule_batch import Req


class PriorityPolicy(SchedulePolicy):
    """Orders by descending ``req.priority``; first come, first served within a level."""

    def order(self, queue: list[Req], ctx: PolicyContext) -> list[Req]:
        return sorted(queue, key=lambda r: (-r.priority, r.arrival_seq))

    def preempt(self, running: list[Req], waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        """Running requests to retract so that more urgent waiting ones can start.

        The most urgent waiting requests are paired, one for one, with the least
        urgent running ones; a running request is chosen while its partner strictly
        outranks it. So every victim is below the highest waiting priority, victims
        come lowest priority first, and there are never more victims than waiting
        requests that outrank them. Among running requests of one level the latest
        arrival goes first, matching the fcfs order the level is admitted in.

        Returns:
            The victims, in the order they should be retracted; empty when
            ``ctx.enable_preemption`` is off.
        """
        if not ctx.enable_preemption or not running or not waiting:
            return []
        urgent = sorted(waiting, key=lambda r: (-r.priority, r.arrival_seq))
        candidates = sorted(running, key=lambda r: (r.priority, -r.arrival_seq))
        victims: list[Req] = []
        for want, have in zip(urgent, candidates, strict=False):  # one victim per outranking request at most
            if want.priority <= have.priority:
                break
            victims.append(have)
        return victims
