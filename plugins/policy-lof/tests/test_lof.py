from __future__ import annotations

import pytest

from engine.managers.policy import PolicyContext
from engine.managers.schedule_batch import Req
from engine.sampling.sampling_params import SamplingParams
from engine.testing import SchedulePolicyConformance
from engine_policy_lof import LofPolicy


class TestLof(SchedulePolicyConformance):
    policy_name = "lof"


def _req(rid: str, max_new_tokens: int) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens), set())


def test_longest_output_first_ties_by_arrival() -> None:
    reqs = [_req("a", 16), _req("b", 128), _req("c", 16), _req("d", 1), _req("e", 128)]
    ordered = LofPolicy().order(list(reversed(reqs)), PolicyContext())
    assert [r.rid for r in ordered] == ["b", "e", "a", "c", "d"]


def test_declared_budget_counts_not_progress() -> None:
    # A half-done long request still outranks a fresh shorter one: its place is stable.
    long_req, short_req = _req("long", 100), _req("short", 60)
    long_req.output_ids = list(range(50))
    ordered = LofPolicy().order([short_req, long_req], PolicyContext())
    assert [r.rid for r in ordered] == ["long", "short"]


# -- end to end through the scheduler ------------------------------------------------------
_SHARED = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
_PROMPTS = [[40, 41, 42], _SHARED + [1, 2, 3], [40, 41, 43, 44], _SHARED + [1, 2, 4, 5],
            _SHARED[:4] + [60], _SHARED + [30, 31]]
# Different budgets so lof really reorders the queue.
_MAX_NEW = [3, 8, 5, 8, 2, 6]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM")


def _run(path: str, policy: str) -> tuple[object, list[list[int]]]:
    from engine.testing.harness import OutputCollector, make_scheduler, submit

    # Two at a time so the order matters across several prefill rounds.
    sched = make_scheduler(path, schedule_policy=policy, max_total_tokens=4096, max_running_requests=2)
    rids = [submit(sched, p, {"max_new_tokens": n, "temperature": 0.0})
            for p, n in zip(_PROMPTS, _MAX_NEW, strict=True)]
    out = OutputCollector()
    while sched.step():
        out.collect(sched)
    out.collect(sched)
    return sched, [out.ids.get(r, []) for r in rids]


@pytest.mark.slow
def test_greedy_outputs_match_fcfs(tiny_llama: str) -> None:
    sched, got = _run(tiny_llama, "lof")
    assert isinstance(sched.policy, LofPolicy)
    assert got == _run(tiny_llama, "fcfs")[1]
    assert [len(ids) for ids in got] == _MAX_NEW
