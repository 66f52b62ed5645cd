"""The router: per-replica bookkeeping around a router policy (one per tokenizer manager).

The tokenizer manager calls ``route`` before sending a request and ``finish`` when the
request ends (finished, aborted, or its client went away); the router keeps which replica
serves which request (so aborts and stop-string aborts reach the right replica), the
in-flight load the policy sees, and the counts ``/metrics`` and ``/get_server_info`` show.
With one replica no policy runs: every request goes to replica 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError
from engine.router.policy import ReplicaLoad, RouteDecision, RouteRequest, RouterPolicy


@dataclass
class _Replica:
    in_flight: dict[str, int] = field(default_factory=dict)  # rid -> prompt tokens
    in_flight_tokens: int = 0
    routed: int = 0
    decisions: dict[str, int] = field(default_factory=dict)  # reason -> count


class Router:
    """Routes requests over ``num_replicas`` replicas with ``policy`` (None: one replica)."""

    def __init__(self, num_replicas: int, policy: RouterPolicy | None = None, policy_name: str = "") -> None:
        if num_replicas > 1 and policy is None:
            raise ValueError("several replicas need a router policy")
        self.num_replicas = num_replicas
        self.policy = policy
        self.policy_name = policy_name if num_replicas > 1 else ""
        self._replicas = [_Replica() for _ in range(num_replicas)]
        self._replica_of: dict[str, int] = {}

    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(i, len(r.in_flight), r.in_flight_tokens, r.routed) for i, r in enumerate(self._replicas)]

    def route(self, rid: str, input_ids: Sequence[int]) -> RouteDecision:
        """Picks the replica for a new request and records it as in flight there."""
        if self.policy is None:
            decision = RouteDecision(0, "single")
        else:
            decision = self.policy.route(RouteRequest(rid, input_ids), self.loads())
            if not isinstance(decision, RouteDecision) or not 0 <= decision.replica < self.num_replicas:
                raise EngineError(f"router policy '{self.policy_name}' returned {decision!r}; expected a "
                                  f"RouteDecision with replica in 0..{self.num_replicas - 1}")
        replica = self._replicas[decision.replica]
        replica.in_flight[rid] = len(input_ids)
        replica.in_flight_tokens += len(input_ids)
        replica.routed += 1
        reason = decision.reason or "unspecified"
        replica.decisions[reason] = replica.decisions.get(reason, 0) + 1
        self._replica_of[rid] = decision.replica
        return decision

    def replica_of(self, rid: str) -> int | None:
        """The replica serving ``rid`` (None once it finished, or for an unknown id)."""
        return self._replica_of.get(rid)

    def finish(self, rid: str) -> None:
        """``rid`` ended (any way): its load leaves its replica. Unknown ids are ignored."""
        index = self._replica_of.pop(rid, None)
        if index is None:
            return
        replica = self._replicas[index]
        replica.in_flight_tokens -= replica.in_flight.pop(rid, 0)
        if self.policy is not None:
            self.policy.on_finish(index, rid)

    def flushed(self) -> None:
        """Every replica emptied its prefix cache."""
        if self.policy is not None:
            self.policy.on_flush()

    def stats(self) -> dict[str, Any]:
        """The router's state for ``/get_server_info`` (``router``)."""
        return {
            "dp_size": self.num_replicas,
            "policy": self.policy_name or None,
            "replicas": [{"index": i, "in_flight_requests": len(r.in_flight), "in_flight_tokens": r.in_flight_tokens,
                          "routed_requests": r.routed, "decisions": dict(r.decisions)}
                         for i, r in enumerate(self._replicas)],
            "policy_state": self.policy.stats() if self.policy is not None else {},
        }


def merge_control_replies(replies: list[Any]) -> Any:
    """One ``ControlReply`` for the replies of several replicas (``--dp-size`` > 1).

    ``ok`` when every replica's is; in ``data``, numbers (not booleans) are summed over the
    replicas, ``kv_usage`` is recomputed from the sums, other values are replica 0's, and
    ``dp_replicas`` lists each replica's own ``data``.
    """
    from engine.managers.io_struct import ControlReply

    datas = [dict(r.data) for r in replies]
    merged: dict[str, Any] = {}
    for key, value in datas[0].items():
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric and all(isinstance(d.get(key), (int, float)) and not isinstance(d.get(key), bool) for d in datas):
            merged[key] = sum(d[key] for d in datas)
        else:
            merged[key] = value
    if "kv_usage" in merged and merged.get("max_total_num_tokens"):
        merged["kv_usage"] = merged.get("kv_used_tokens", 0) / merged["max_total_num_tokens"]
    merged["dp_replicas"] = datas
    first = replies[0]
    return ControlReply(first.kind, first.token, ok=all(r.ok for r in replies), data=merged)
