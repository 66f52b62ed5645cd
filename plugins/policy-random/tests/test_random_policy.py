from __future__ import annotations

import random

import pytest

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


# -- end to end through the scheduler ------------------------------------------------------
_SHARED = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
_PROMPTS = [[40, 41, 42], _SHARED + [1, 2, 3], [40, 41, 43, 44], _SHARED + [1, 2, 4, 5],
            _SHARED[:4] + [60], _SHARED + [30, 31]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM")


def _run(path: str, policy: str) -> tuple[object, list[list[int]]]:
    from engine.testing.harness import generate_greedy, make_scheduler

    # Two at a time so the order matters across several prefill rounds.
    sched = make_scheduler(path, schedule_policy=policy, max_total_tokens=4096, max_running_requests=2)
    return sched, generate_greedy(sched, _PROMPTS, 8)


@pytest.mark.slow
def test_greedy_outputs_match_fcfs(tiny_llama: str) -> None:
    sched, got = _run(tiny_llama, "random")
    assert isinstance(sched.policy, RandomPolicy)
    assert got == _run(tiny_llama, "fcfs")[1]
    assert all(len(ids) == 8 for ids in got)
