from __future__ import annotations


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
