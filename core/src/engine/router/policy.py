"""The router-policy contract: which data-parallel replica serves a request.

Router-policy plugins subclass ``RouterPolicy`` and register a ``RouterPolicySpec``
(hook ``register_router_policies``, hook API 4). The router calls ``route`` once per
request, in the main process, on the event loop: it must be quick (no I/O) and never
block. A policy learns about the replicas only through what the router tells it: the
loads it passes to ``route`` (requests sent and not yet finished) and the ``on_finish``
and ``on_flush`` calls. It never hears from the replicas themselves, so a cache-aware
policy keeps an *approximate* picture of each replica's prefix cache, updated from its
own decisions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica's load when a request arrives."""

    # Replica index, 0..dp_size-1.
    index: int
    # Requests routed to it that have not finished (running or queued there).
    in_flight_requests: int
    # Prompt tokens of those requests.
    in_flight_tokens: int
    # Requests routed to it since start (finished or not).
    routed_requests: int


@dataclass(frozen=True)
class RouteRequest:
    """The request being routed."""

    # The request id (unique among running requests).
    rid: str
    # Its prompt token ids: what the replica's radix cache is keyed by.
    input_ids: Sequence[int]


@dataclass(frozen=True)
class RouteDecision:
    """A policy's answer."""

    # The replica that serves the request, 0..dp_size-1.
    replica: int
    # Why, as a short label counted in ``/metrics`` (``engine_router_decisions_total``):
    # "cache_hit" for a choice made because the replica's cached prefixes matched; built-ins
    # also say "load_balance", "least_loaded", "round_robin", "shortest_queue".
    reason: str = ""
    # Prompt tokens the policy believes the replica has cached (0 when it does not know).
    matched_tokens: int = 0


class RouterPolicy(ABC):
    """Chooses a replica per request; one instance per server, built by the spec's factory as
    ``factory(num_replicas, options=...)``."""

    def __init__(self, num_replicas: int, options: dict[str, Any] | None = None) -> None:
        self.num_replicas = num_replicas
        self.options = dict(options or {})

    @abstractmethod
    def route(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> RouteDecision:
        """The replica for ``request``; ``loads[i]`` is replica ``i``'s load before it."""

    def on_finish(self, replica: int, rid: str) -> None:
        """``rid``, routed to ``replica``, finished or was aborted (default: nothing)."""

    def on_flush(self) -> None:
        """Every replica's prefix cache was emptied (``/flush_cache``): forget cached prefixes."""

    def stats(self) -> dict[str, Any]:
        """Policy-specific numbers for ``/get_server_info`` (``router.policy_state``), JSON-ready."""
        return {}
