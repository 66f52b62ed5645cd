"""``RouterPolicyConformance``: a router policy answers every request with a valid replica,
deterministically, and survives the router's notifications."""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

import pytest

from engine import plugins


class RouterPolicyConformance:
    """Set ``policy_name``. Routing runs on the server's event loop for every request, so the
    kit also checks that a policy keeps up with a long stream of long prompts."""

    policy_name: ClassVar[str] = ""
    #: replica counts the kit routes over.
    replica_counts: ClassVar[tuple[int, ...]] = (2, 3, 8)
    seed: ClassVar[int] = 1234

    def _policy(self, num_replicas: int) -> Any:
        return plugins.create_router_policy(self.policy_name, num_replicas)

    def _run(self, num_replicas: int, num_requests: int = 200) -> list[Any]:
        """Routes a seeded stream of prompts (many sharing prefixes) through a ``Router``, finishing
        some requests on the way; returns the decisions."""
        from engine.router.router import Router

        rng = random.Random(self.seed * 31 + num_replicas)
        router = Router(num_replicas, self._policy(num_replicas), self.policy_name)
        prefixes = [[rng.randrange(1000) for _ in range(rng.randint(1, 64))] for _ in range(6)]
        decisions, running = [], []
        for i in range(num_requests):
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 32))]
            decision = router.route(f"r{i}", prompt)
            decisions.append(decision)
            running.append(f"r{i}")
            if rng.random() < 0.5:
                router.finish(running.pop(rng.randrange(len(running))))
            if i == num_requests // 2:
                router.flushed()
        return decisions

    @pytest.mark.parametrize("num_replicas", [1, 2, 3])
    def test_spec_and_factory(self, num_replicas: int) -> None:
        from engine.router import RouterPolicy

        spec = plugins.get_router_policy(self.policy_name)
        assert spec.name == self.policy_name
        policy = self._policy(num_replicas)
        assert isinstance(policy, RouterPolicy), f"the factory returned {type(policy).__name__}, not a RouterPolicy"
        assert policy.num_replicas == num_replicas

    def test_routes_to_valid_replicas(self) -> None:
        from engine.router import RouteDecision

        for n in self.replica_counts:
            for decision in self._run(n):
                assert isinstance(decision, RouteDecision)
                assert 0 <= decision.replica < n, decision
                assert isinstance(decision.reason, str) and decision.reason, "say why (a reason label for /metrics)"
                assert decision.matched_tokens >= 0

    def test_deterministic(self) -> None:
        """The same requests, loads and notifications give the same decisions (reproducible runs)."""
        for n in self.replica_counts:
            first = [(d.replica, d.reason) for d in self._run(n)]
            assert first == [(d.replica, d.reason) for d in self._run(n)]

    def test_uses_every_replica_under_load(self) -> None:
        """Spreading is a router's job: with requests piling up (none finishes), every replica gets some."""
        from engine.router.router import Router

        n = 3
        router = Router(n, self._policy(n), self.policy_name)
        rng = random.Random(self.seed)
        used = {router.route(f"r{i}", [rng.randrange(1000) for _ in range(16)]).replica for i in range(600)}
        assert used == set(range(n)), f"600 unfinished requests used only replicas {sorted(used)} of {n}"

    def test_stats_are_json(self) -> None:
        from engine.router.router import Router

        router = Router(2, self._policy(2), self.policy_name)
        for i in range(20):
            router.route(f"r{i}", [i, i + 1, i + 2])
        json.dumps(router.stats())
