from __future__ import annotations

import pytest

from engine import plugins
from engine.managers.policy import PolicyContext
from engine.managers.schedule_batch import Req
from engine.sampling.sampling_params import SamplingParams
from engine.testing import SchedulePolicyConformance
from engine_policy_lpm import FCFS_FALLBACK_QUEUE_LEN, LpmPolicy


class TestLpm(SchedulePolicyConformance):
    policy_name = "lpm"


def _req(rid: str, prefix_len_hint: int) -> Req:
    req = Req(rid, list(range(64)), SamplingParams(max_new_tokens=8), set())
    req.prefix_len_hint = prefix_len_hint
    return req


def test_spec_is_cache_aware() -> None:
    assert plugins.get_schedule_policy("lpm").cache_aware


def test_longest_prefix_first_ties_by_arrival() -> None:
    reqs = [_req("a", 3), _req("b", 10), _req("c", 3), _req("d", 0), _req("e", 10)]
    ordered = LpmPolicy().order(list(reversed(reqs)), PolicyContext())
    assert [r.rid for r in ordered] == ["b", "e", "a", "c", "d"]


def test_long_queue_falls_back_to_arrival_order() -> None:
    # Later arrivals get longer prefixes, so lpm proper would reverse the queue.
    reqs = [_req(f"r{i}", i) for i in range(FCFS_FALLBACK_QUEUE_LEN + 1)]
    ordered = LpmPolicy().order(list(reversed(reqs)), PolicyContext())
    assert [r.rid for r in ordered] == [r.rid for r in reqs]
    at_limit = LpmPolicy().order(reqs[:FCFS_FALLBACK_QUEUE_LEN], PolicyContext())
    assert at_limit[0].rid == f"r{FCFS_FALLBACK_QUEUE_LEN - 1}"


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
    # Warm the radix cache so the policy sees real prefix hits.
    generate_greedy(sched, [_SHARED + [1, 2]], 2)
    return sched, generate_greedy(sched, _PROMPTS, 8)


@pytest.mark.slow
def test_greedy_outputs_match_fcfs(tiny_llama: str) -> None:
    sched, got = _run(tiny_llama, "lpm")
    assert isinstance(sched.policy, LpmPolicy) and sched.policy.cache_aware
    assert got == _run(tiny_llama, "fcfs")[1]
    assert all(len(ids) == 8 for ids in got)
