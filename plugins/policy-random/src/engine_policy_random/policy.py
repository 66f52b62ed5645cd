"""The ``random`` schedule policy's implementation, imported when the policy is selected
(the package's ``__init__`` only registers it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.managers.policy import PolicyContext, SchedulePolicy

if TYPE_CHECKING:
    from engine.managers.schedule_batch import Req


class RandomPolicy(SchedulePolicy):
    """Shuffles the queue with ``ctx.rng``.

    The queue is put in arrival order before shuffling, so the result depends only on
    the set of requests and the generator's state, not on how the scheduler happened
    to leave the list: the same seed gives the same order.
    """

    def order(self, queue: list[Req], ctx: PolicyContext) -> list[Req]:
        shuffled = sorted(queue, key=lambda r: r.arrival_seq)
        ctx.rng.shuffle(shuffled)
        return shuffled
