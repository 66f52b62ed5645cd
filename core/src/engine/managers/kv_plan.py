"""The KV pool's future for requests that run to their length, and tail-first admission.

A request that cannot stop early (``Req.runs_to_length``: ``ignore_eos`` and no stop
conditions) takes one more KV slot each decode step until it has generated ``max_new_tokens``,
then frees all of its slots at once. For such requests the pool's use at every future step is
known, so admission can ask "does the pool ever overflow" instead of setting aside every
request's whole remainder at once: requests that finish earlier free their slots before later
ones reach their longest.

That exact view also shows why a burst larger than the pool ends in a small, slow tail: when
the requests that fit start together, the rest start only after all of them finished and then
decode on their own for their whole length. Starting that remainder first and the large group
once it fits beside it (the large group reaches its peak after the small one finished) gives
the same tokens in fewer decode steps (``tail_first_limit``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def projected_peak(base: np.ndarray, left: np.ndarray, slack: int = 0) -> int:
    """Most slots the requests hold together at any future step.

    Request ``i`` holds ``base[i] + t`` slots ``t`` steps from now while ``t <= left[i]`` and
    none afterwards (``slack`` slots more while it runs: partly filled pages). The peak is at
    some request's last step, so it is the largest, over the requests sorted by ``left``
    descending, of (the slots of those running at least that long) + count x that step.
    """
    if base.size == 0:
        return 0
    order = np.argsort(-left, kind="stable")
    held = np.cumsum(base[order] + slack)
    steps = np.maximum(left[order], 0)
    return int(np.max(held + np.arange(1, base.size + 1) * steps))


class KvPlan:
    """The run-to-length requests of one admission round: running, and admitted this round.

    ``need()`` is how many more free slots than now the plan's peak takes: the peak less the
    slots its requests already hold (allocated, or a locked cached prefix).
    """

    def __init__(self, page_size: int = 1) -> None:
        self.slack = page_size if page_size > 1 else 0
        self.base: list[int] = []
        self.left: list[int] = []
        self.held = 0
        self._need: int | None = 0
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, base: int, left: int, held: int) -> None:
        """A request that will hold ``base`` slots after its prefill (``held`` of them now) and
        take one more a step for ``left`` steps."""
        self.base.append(base)
        self.left.append(left)
        self.held += held
        self._need = None
        self._arrays = None

    def need(self) -> int:
        if self._need is None:
            self._need = self._need_with(_EMPTY, _EMPTY)
        return self._need

    def extra_need(self, base: int, left: int, held: int) -> int:
        """Free slots adding one such request takes beyond ``need()``."""
        return self._need_with(np.array([base]), np.array([left])) - held - self.need()

    def fits_with(self, bases: np.ndarray, lefts: np.ndarray, free: int) -> bool:
        """Whether requests with these (not yet held) slots fit beside the plan in ``free`` slots."""
        return self._need_with(bases, lefts) <= free

    def _need_with(self, bases: np.ndarray, lefts: np.ndarray) -> int:
        if self._arrays is None:
            self._arrays = (np.asarray(self.base, dtype=np.int64), np.asarray(self.left, dtype=np.int64))
        base, left = self._arrays
        if bases.size:
            base, left = np.concatenate([base, bases]), np.concatenate([left, lefts])
        return projected_peak(base, left, self.slack) - self.held


_EMPTY = np.zeros(0, dtype=np.int64)


def largest_group_fitting(bases: np.ndarray, lefts: np.ndarray, capacity: int, slack: int = 0) -> int:
    """How many of the last requests of the arrays fit together, started at once, in ``capacity`` slots."""
    lo, hi = 0, len(bases)
    while lo < hi:  # the peak grows with every request added: binary search on the count
        mid = (lo + hi + 1) // 2
        if projected_peak(bases[len(bases) - mid:], lefts[len(lefts) - mid:], slack) <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tail_first_limit(plan: KvPlan, bases: Sequence[int], lefts: Sequence[int], free: int,
                     capacity: int) -> int | None:
    """How many waiting requests (all run-to-length, in queue order) this round may admit; None
    for no limit.

    ``free``: slots free for them now beside ``plan`` (the running requests); ``capacity``: the
    slots they would have once the running requests finished. When all of them fit now, no
    limit. Otherwise the last ``g`` that fit together in ``capacity`` are kept back as one group:
    only the ones before them are admitted now (they start first and finish first), and once
    no others are left, the group is admitted only when all of it fits. Either hold pays only
    if the group can start while the requests before it still run; when it could start only
    after they ended, holding changes no step count and only makes more requests wait: no
    limit then (admission takes whatever fits, in queue order). That check is made every round,
    not only on the first: admission takes a chunk's worth of prompts a round, so a burst is
    admitted over many rounds, and the rounds after the first see running requests.
    """
    base, left = np.asarray(bases, dtype=np.int64), np.asarray(lefts, dtype=np.int64)
    if not base.size or plan.fits_with(base, left, free):
        return None
    group = largest_group_fitting(base, left, capacity, plan.slack)
    if group == 0:
        return None  # not even one fits an empty pool: admission's own checks decide
    if len(base) <= group:
        return 0 if _overlaps(plan, _EMPTY, _EMPTY, base, left, free + plan.held) else None
    front = len(base) - group
    if not _overlaps(plan, base[:front], left[:front], base[front:], left[front:], free + plan.held):
        return None
    return front


def _overlaps(plan: KvPlan, front_base: np.ndarray, front_left: np.ndarray, group_base: np.ndarray,
              group_left: np.ndarray, total: int) -> bool:
    """Whether the group, started at the last step the front (started now) or else the plan still
    runs, fits beside them within ``total`` slots. That is the latest start that overlaps them,
    and the easiest: the later it starts, the less of its growth meets theirs. With neither a
    front nor a plan there is nothing to overlap: True."""
    lefts = front_left if front_left.size else np.asarray(plan.left, dtype=np.int64)
    if not lefts.size:
        return True
    at = int(lefts.max())
    base = np.concatenate([np.asarray(plan.base, dtype=np.int64), front_base]) + at
    left = np.concatenate([np.asarray(plan.left, dtype=np.int64), front_left]) - at
    alive = left >= 0
    both_base = np.concatenate([base[alive], group_base])
    both_left = np.concatenate([left[alive], group_left])
    return projected_peak(both_base, both_left, plan.slack) <= total
