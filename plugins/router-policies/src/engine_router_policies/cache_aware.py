"""The ``cache-aware`` router policy (the idea of SGLang's router, written for this engine).

Per request:

1. If the replicas are unevenly loaded (the busiest has more than ``balance_abs_threshold``
   in-flight requests more than the idlest *and* more than ``balance_rel_threshold`` times
   as many), the idlest gets it: reason ``load_balance``.
2. Else the prompt is matched against each replica's approximate radix tree
   (``ApproxRadixTree``); when the best match covers more than ``cache_threshold`` of the
   prompt, that replica gets it (ties: the less loaded): reason ``cache_hit``.
3. Else the least loaded replica gets it: reason ``least_loaded``.

The chosen replica's tree then records the prompt, so later requests sharing its prefix
follow it there, where the replica's radix cache most likely still holds the prefix's KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.router import ReplicaLoad, RouteDecision, RouteRequest, RouterPolicy
from engine_router_policies.radix_tree import ApproxRadixTree
from engine_router_policies.simple import least_loaded

DEFAULTS: dict[str, Any] = {"cache_threshold": 0.3, "balance_abs_threshold": 64, "balance_rel_threshold": 1.5,
                            "max_tree_tokens": 1 << 22}


class CacheAwarePolicy(RouterPolicy):
    def __init__(self, num_replicas: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(num_replicas, {**DEFAULTS, **(options or {})})
        opts = self.options
        self.cache_threshold = float(opts["cache_threshold"])
        self.balance_abs_threshold = int(opts["balance_abs_threshold"])
        self.balance_rel_threshold = float(opts["balance_rel_threshold"])
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"router_policies.cache_threshold: invalid value {self.cache_threshold}; accepted: 0..1")
        self.trees = [ApproxRadixTree(int(opts["max_tree_tokens"])) for _ in range(num_replicas)]

    def imbalanced(self, loads: Sequence[ReplicaLoad]) -> bool:
        counts = [r.in_flight_requests for r in loads]
        busiest, idlest = max(counts), min(counts)
        return busiest - idlest > self.balance_abs_threshold and busiest > idlest * self.balance_rel_threshold

    def route(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> RouteDecision:
        ids = request.input_ids
        matches = [tree.match_prefix(ids) for tree in self.trees]
        if self.imbalanced(loads):
            replica, reason = least_loaded(loads), "load_balance"
        else:
            load = {r.index: (r.in_flight_requests, r.in_flight_tokens) for r in loads}
            best = max(range(self.num_replicas), key=lambda i: (matches[i], tuple(-x for x in load[i]), -i))
            if ids and matches[best] / len(ids) > self.cache_threshold:
                replica, reason = best, "cache_hit"
            else:
                replica, reason = least_loaded(loads), "least_loaded"
        self.trees[replica].insert(ids)
        return RouteDecision(replica, reason, matches[replica])

    def on_flush(self) -> None:
        for tree in self.trees:
            tree.clear()

    def stats(self) -> dict[str, Any]:
        return {"tree_tokens": [tree.size for tree in self.trees], "cache_threshold": self.cache_threshold,
                "balance_abs_threshold": self.balance_abs_threshold,
                "balance_rel_threshold": self.balance_rel_threshold}
