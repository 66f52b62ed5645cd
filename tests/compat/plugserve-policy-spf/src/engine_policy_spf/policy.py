"""Shortest prompt first: short requests are not held up behind long prefills."""

from __future__ import annotations

from engine.managers.policy import PolicyContext, SchedulePolicy


class ShortestPromptFirst(SchedulePolicy):
    def order(self, queue, ctx: PolicyContext):  # type: ignore[no-untyped-def]
        # The scheduler sets prefix_len_hint (tokens already in the prefix cache) before asking a
        # cache-aware policy, so the key is what prefill still has to compute.
        return sorted(queue, key=lambda r: (len(r.origin_input_ids) - r.prefix_len_hint, r.arrival_seq))
