"""Data parallelism's front half: the router that picks a replica for each request.

``--dp-size N`` runs N replicas of the model (each its own scheduler process, KV pool and
radix cache, on its own device(s)) behind one tokenizer manager and one detokenizer. The
tokenizer manager asks the ``Router`` (``engine.router.router``) which replica gets each
request; the choice itself is a router-policy plugin (``engine.router.policy`` is the
contract; ``--router-policy cache-aware|round-robin|shortest-queue`` are the built-ins of
``plugserve-router-policies``). docs/parallelism.md, "Data parallelism and the router",
explains the design.
"""

from engine.router.policy import ReplicaLoad, RouteDecision, RouteRequest, RouterPolicy

__all__ = ["ReplicaLoad", "RouteDecision", "RouteRequest", "RouterPolicy"]
