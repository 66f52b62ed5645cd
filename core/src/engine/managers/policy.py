"""The schedule-policy contract: how the waiting queue is ordered.

Policy plugins subclass ``SchedulePolicy``. Before calling a cache-aware policy
the scheduler sets ``req.prefix_len_hint`` (tokens of the prompt already in the
prefix cache) and ``req.last_node`` (an opaque node of the cache), and hands the
policy a ``PolicyContext`` whose ``parent_of`` walks towards the cache's root, so
a policy never imports the cache. Nodes are hashable by identity and may be used as
dict keys within one ``order`` call.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.managers.schedule_batch import Req


@dataclass
class PolicyContext:
    # Parent of a prefix-cache node, or None at the root (cache-aware policies only).
    parent_of: Callable[[Any], Any | None] = lambda node: None
    # Seeded generator for policies that draw at random (reproducible orders).
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    # Whether priority preemption is enabled (priority policy).
    enable_preemption: bool = False


class SchedulePolicy(ABC):
    """Orders the waiting queue; must be deterministic for the same inputs and context."""

    #: set by the plugin spec: whether prefix-match information is needed.
    cache_aware: bool = False

    def needs_prefix_match(self, queue_len: int) -> bool:
        """Whether the scheduler should compute prefix matches before this ``order`` call.

        Defaults to ``cache_aware``; a policy that ignores them for long queues says so here,
        sparing the scheduler a radix-tree walk per waiting request.
        """
        return self.cache_aware

    @abstractmethod
    def order(self, queue: list[Req], ctx: PolicyContext) -> list[Req]:
        """Returns the queue's requests in the order they should be admitted."""

    def preempt(self, running: list[Req], waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        """Running requests to retract so more urgent waiting ones can run (default: none)."""
        return []
