from __future__ import annotations

from engine.managers.policy import PolicyContext
from engine.testing import SchedulePolicyConformance
from engine_policy_fcfs import FcfsPolicy


class TestFcfs(SchedulePolicyConformance):
    policy_name = "fcfs"


def test_fcfs_orders_by_arrival() -> None:
    reqs = SchedulePolicyConformance()._queue(3)
    shuffled = list(reversed(reqs))
    ordered = FcfsPolicy().order(shuffled, PolicyContext())
    assert [r.arrival_seq for r in ordered] == sorted(r.arrival_seq for r in reqs)
