from __future__ import annotations

import pytest

from engine import plugins
from engine.router import ReplicaLoad, RouteRequest
from engine.router.router import Router
from engine.testing import RouterPolicyConformance
from engine_router_policies.cache_aware import CacheAwarePolicy
from engine_router_policies.simple import RoundRobinPolicy, ShortestQueuePolicy


class TestCacheAware(RouterPolicyConformance):
    policy_name = "cache-aware"


class TestRoundRobin(RouterPolicyConformance):
    policy_name = "round-robin"


class TestShortestQueue(RouterPolicyConformance):
    policy_name = "shortest-queue"


def _loads(*in_flight: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, n, 10 * n, 0) for i, n in enumerate(in_flight)]


def test_round_robin_alternates_whatever_the_load() -> None:
    policy = RoundRobinPolicy(3)
    picks = [policy.route(RouteRequest(f"r{i}", [1, 2]), _loads(100, 0, 0)).replica for i in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_picks_the_least_loaded() -> None:
    policy = ShortestQueuePolicy(3)
    assert policy.route(RouteRequest("a", [1]), _loads(4, 2, 3)).replica == 1
    assert policy.route(RouteRequest("b", [1]), _loads(0, 2, 0)).replica == 0  # tie: lowest index
    # Ties on requests go to fewer in-flight tokens, then fewer routed so far.
    loads = [ReplicaLoad(0, 1, 500, 9), ReplicaLoad(1, 1, 20, 9), ReplicaLoad(2, 1, 20, 3)]
    assert policy.route(RouteRequest("c", [1]), loads).replica == 2


def test_shortest_queue_through_the_router_follows_finishes() -> None:
    router = Router(2, ShortestQueuePolicy(2), "shortest-queue")
    assert [router.route(f"r{i}", [1, 2, 3]).replica for i in range(4)] == [0, 1, 0, 1]
    router.finish("r1")
    router.finish("r3")  # replica 1 is idle now
    assert router.route("r4", [1]).replica == 1


def test_cache_aware_sends_shared_prefixes_to_the_same_replica() -> None:
    router = Router(2, CacheAwarePolicy(2), "cache-aware")
    system_a, system_b = list(range(100, 140)), list(range(200, 240))
    first_a = router.route("a0", system_a + [1, 2])
    first_b = router.route("b0", system_b + [1, 2])
    assert first_a.reason == first_b.reason == "least_loaded"
    assert first_a.replica != first_b.replica  # the second goes to the idle replica
    for i in range(1, 6):
        da = router.route(f"a{i}", system_a + [i, i])
        db = router.route(f"b{i}", system_b + [i, i])
        assert (da.replica, da.reason) == (first_a.replica, "cache_hit") and da.matched_tokens >= 40
        assert (db.replica, db.reason) == (first_b.replica, "cache_hit")
    stats = router.stats()
    assert sum(r["decisions"].get("cache_hit", 0) for r in stats["replicas"]) == 10


def test_cache_aware_threshold_and_flush() -> None:
    policy = CacheAwarePolicy(2, {"cache_threshold": 0.5})
    router = Router(2, policy, "cache-aware")
    assert router.route("x", [1, 2, 3, 4]).replica == 0
    # 2 of 5 tokens match replica 0 (0.4 <= 0.5): not a cache hit, the less loaded replica gets it.
    d = router.route("y", [1, 2, 9, 9, 9])
    assert (d.replica, d.reason) == (1, "least_loaded")
    d = router.route("z", [1, 2, 3, 4, 7])  # 4 of 5: a hit on replica 0 although it is as loaded
    assert (d.replica, d.reason) == (0, "cache_hit")
    router.flushed()
    assert policy.stats()["tree_tokens"] == [0, 0]


def test_cache_aware_balances_unevenly_loaded_replicas() -> None:
    prompt = list(range(50))

    def route(*in_flight: int) -> tuple[int, str]:
        policy = CacheAwarePolicy(2, {"balance_abs_threshold": 4, "balance_rel_threshold": 1.5})
        policy.trees[0].insert(prompt)  # replica 0 holds the prompt's prefix
        d = policy.route(RouteRequest("r", prompt), _loads(*in_flight))
        return d.replica, d.reason

    # 5 more in flight on replica 0 (> 4 and > 1.5 x 0): the prefix match is ignored.
    assert route(5, 0) == (1, "load_balance")
    # 4 more (not > 4): the match wins.
    assert route(4, 0) == (0, "cache_hit")
    # 13 vs 9: more than 4 apart but not 1.5 times as many.
    assert route(13, 9) == (0, "cache_hit")
    assert route(14, 9) == (1, "load_balance")


def test_cache_aware_option_checks() -> None:
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAwarePolicy(2, {"cache_threshold": 1.5})
    # The plugin's declared options reach the factory.
    policy = plugins.create_router_policy("cache-aware", 2, plugin_options={"router_policies": {"cache_threshold": 0.9}})
    assert policy.cache_threshold == 0.9
