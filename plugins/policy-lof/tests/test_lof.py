from __future__ import annotations


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
