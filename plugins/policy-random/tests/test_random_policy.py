from __future__ import annotations

import random


from engine.managers.policy import PolicyContext
from engine.testing import SchedulePolicyConformance
from engine_policy_random import RandomPolicy


class TestRandom(SchedulePolicyConformance):
    policy_name = "random"


def _rids(reqs: list) -> list[str]:  # type: ignore[type-arg]
    return [r.rid for r in reqs]


def test_same_seed_same_order_whatever_the_input_order() -> None:
    queue = SchedulePolicyConformance()._queue(1)
    first = RandomPolicy().order(list(queue), PolicyContext(rng=random.Random(42)))
    second = RandomPolicy().order(list(reversed(queue)), PolicyContext(rng=random.Random(42)))
    assert _rids(first) == _rids(second)
    assert sorted(_rids(first)) == sorted(_rids(queue))


def test_different_seeds_shuffle_differently() -> None:
    queue = SchedulePolicyConformance()._queue(1)
    orders = {tuple(_rids(RandomPolicy().order(list(queue), PolicyContext(rng=random.Random(s)))))
              for s in range(5)}
    assert len(orders) > 1


def test_successive_calls_draw_fresh_orders_from_one_context() -> None:
    queue = SchedulePolicyConformance()._queue(1)
    ctx = PolicyContext(rng=random.Random(3))
    first = RandomPolicy().order(list(queue), ctx)
    assert _rids(first) != _rids(RandomPolicy().order(list(queue), ctx))
