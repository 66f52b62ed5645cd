"""The load-only router policies: ``round-robin`` and ``shortest-queue``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.router import ReplicaLoad, RouteDecision, RouteRequest, RouterPolicy


class RoundRobinPolicy(RouterPolicy):
    """Replica 0, 1, ..., N-1, 0, ... whatever their load."""

    def __init__(self, num_replicas: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(num_replicas, options)
        self._next = 0

    def route(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> RouteDecision:
        replica = self._next
        self._next = (self._next + 1) % self.num_replicas
        return RouteDecision(replica, "round_robin")


def least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    """The replica with the fewest in-flight requests; ties go to fewer in-flight prompt tokens,
    then to fewer requests routed so far (so an idle server still spreads), then the lowest index."""
    best = min(loads, key=lambda r: (r.in_flight_requests, r.in_flight_tokens, r.routed_requests, r.index))
    return best.index


class ShortestQueuePolicy(RouterPolicy):
    """The least loaded replica (``least_loaded``)."""

    def route(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> RouteDecision:
        return RouteDecision(least_loaded(loads), "shortest_queue")
