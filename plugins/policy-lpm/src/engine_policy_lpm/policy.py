"""The ``lpm`` schedule policy's implementation, imported when the policy is selected
(the package's ``__init__`` only registers it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.managers.policy import PolicyContext, SchedulePolicy

if TYPE_CHECKING:
    from engine.managers.schedule_batch import Req

#: Above this many waiting requests the order falls back to arrival order (as SGLang
#: does): a huge queue means the server is saturated, and there fairness and a cheap
#: sort matter more than squeezing out a few more cache hits.
FCFS_FALLBACK_QUEUE_LEN = 128


class LpmPolicy(SchedulePolicy):
    """Longest prefix match first, ties in arrival order.

    Reads ``req.prefix_len_hint``, which the scheduler fills from the radix cache
    before each ordering because the spec says ``cache_aware=True``.
    """

    def needs_prefix_match(self, queue_len: int) -> bool:
        # Past the fallback length the order ignores prefixes: skip matching them.
        return queue_len <= FCFS_FALLBACK_QUEUE_LEN

    def order(self, queue: list[Req], ctx: PolicyContext) -> list[Req]:
        if len(queue) > FCFS_FALLBACK_QUEUE_LEN:
            return sorted(queue, key=lambda r: r.arrival_seq)
        return sorted(queue, key=lambda r: (-r.prefix_len_hint, r.arrival_seq))
