from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.errors import EngineError
from engine.managers.io_struct import ControlReply
from engine.router import ReplicaLoad, RouteDecision, RouteRequest, RouterPolicy
from engine.router.router import Router, merge_control_replies


class _Scripted(RouterPolicy):
    """Sends request i to ``script[i]``, recording what the router told it."""

    def __init__(self, num_replicas: int, script: list[int]) -> None:
        super().__init__(num_replicas)
        self.script = list(script)
        self.seen: list[list[ReplicaLoad]] = []
        self.finished: list[tuple[int, str]] = []
        self.flushes = 0

    def route(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> RouteDecision:
        self.seen.append(list(loads))
        return RouteDecision(self.script.pop(0), "scripted")

    def on_finish(self, replica: int, rid: str) -> None:
        self.finished.append((replica, rid))

    def on_flush(self) -> None:
        self.flushes += 1


def test_one_replica_needs_no_policy() -> None:
    router = Router(1)
    assert router.route("a", [1, 2]).replica == 0
    assert router.replica_of("a") == 0
    router.finish("a")
    assert router.replica_of("a") is None
    assert router.stats()["policy"] is None
    with pytest.raises(ValueError):
        Router(2)


def test_loads_follow_routes_and_finishes() -> None:
    policy = _Scripted(2, [0, 1, 0])
    router = Router(2, policy, "scripted")
    router.route("a", [1, 2, 3])
    router.route("b", [1])
    router.route("c", [4, 5])
    assert [router.replica_of(r) for r in "abc"] == [0, 1, 0]
    assert policy.seen[2] == [ReplicaLoad(0, 1, 3, 1), ReplicaLoad(1, 1, 1, 1)]
    router.finish("a")
    router.finish("a")  # twice, or an unknown id: ignored
    router.finish("nope")
    assert policy.finished == [(0, "a")]
    assert router.loads() == [ReplicaLoad(0, 1, 2, 2), ReplicaLoad(1, 1, 1, 1)]
    router.flushed()
    assert policy.flushes == 1
    stats = router.stats()
    assert stats["dp_size"] == 2 and stats["policy"] == "scripted"
    assert [r["routed_requests"] for r in stats["replicas"]] == [2, 1]
    assert stats["replicas"][0]["decisions"] == {"scripted": 2}


def test_a_policy_answering_out_of_range_is_an_error() -> None:
    router = Router(2, _Scripted(2, [2]), "scripted")
    with pytest.raises(EngineError, match="router policy 'scripted' returned .*replica in 0..1"):
        router.route("a", [1])


def test_merge_control_replies_sums_numbers_and_keeps_each_replica() -> None:
    a = ControlReply("server_info", 1, data={"num_running_reqs": 2, "kv_used_tokens": 10, "max_total_num_tokens": 100,
                                               "kv_usage": 0.1, "overlap_schedule": True, "cuda_graph_batch_sizes": []})
    b = ControlReply("server_info", 2, data={"num_running_reqs": 1, "kv_used_tokens": 30, "max_total_num_tokens": 100,
                                               "kv_usage": 0.3, "overlap_schedule": True, "cuda_graph_batch_sizes": []})
    merged = merge_control_replies([a, b])
    assert merged.ok
    assert merged.data["num_running_reqs"] == 3 and merged.data["max_total_num_tokens"] == 200
    assert merged.data["kv_usage"] == pytest.approx(0.2)
    assert merged.data["overlap_schedule"] is True
    assert merged.data["dp_replicas"] == [a.data, b.data]
    busy = ControlReply("flush_cache", 3, ok=False)
    assert not merge_control_replies([ControlReply("flush_cache", 4), busy]).ok
