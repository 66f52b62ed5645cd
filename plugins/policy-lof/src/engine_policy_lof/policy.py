"""The ``lof`` schedule policy's implementation, imported when the policy is selected
(the package's ``__init__`` only registers it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
