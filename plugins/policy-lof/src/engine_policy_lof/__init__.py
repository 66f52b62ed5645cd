"""The ``lof`` schedule policy: the request that may generate the most tokens runs first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.hookspecs import SchedulePolicySpec, hookimpl
from engine.managers.policy import PolicyContext, SchedulePolicy

if TYPE_CHECKING:
    from engine.managers.schedule_batch import Req


class LofPolicy(SchedulePolicy):
    """Largest ``max_new_tokens`` first, ties in arrival order.

    Starting the long generations early lets the short ones fill in around them, which
    shortens the tail of an offline batch; it is the declared budget that counts, not
    what is left of it, so a retracted request keeps its place.
    """

    def order(self, queue: list[Req], ctx: PolicyContext) -> list[Req]:
        return sorted(queue, key=lambda r: (-r.sampling_params.max_new_tokens, r.arrival_seq))


@hookimpl
def register_schedule_policies(register):  # type: ignore[no-untyped-def]
    register(SchedulePolicySpec(name="lof", factory=LofPolicy,
                                description="Longest output (max_new_tokens) first"))
