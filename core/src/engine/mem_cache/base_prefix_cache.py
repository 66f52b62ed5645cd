"""The interface every prefix cache implements, and the result of a prefix match.

A prefix cache owns the KV slots of token sequences that finished (or paused
between prefill chunks), so that a later request with the same prefix can reuse
them instead of recomputing. The scheduler talks to it only through this
interface, so the radix cache and the no-op ``ChunkCache`` (radix cache disabled)
are interchangeable.

Ownership contract shared by all implementations:

* Slots returned by ``match_prefix`` belong to the cache. A request that uses them
  must ``inc_lock_ref(last_node)`` until it releases them with
  ``cache_finished_req`` (which does the matching ``dec_lock_ref``).
* ``req.req_to_token[req.req_pool_idx, :len(req.prefix_indices)]`` must hold the
  request's prefix slots (the scheduler writes them at admission); every slot
  past that position up to the request's KV length is owned by the request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class PrefixCacheReq(Protocol):
    """The attributes of a scheduler request that a prefix cache reads and writes."""

    rid: str
    # Prompt tokens, never changed after tokenization.
    origin_input_ids: list[int]
    # Sampled tokens; the last one has no KV yet.
    output_ids: list[int]
    # Tokens whose KV exists after the current prefill chunk (chunked prefill).
    fill_ids: list[int]
    # Row of ReqToTokenPool.req_to_token, or None when the request holds none.
    req_pool_idx: int | None
    # KV slots (int64) of the cached prefix the request is reusing.
    prefix_indices: torch.Tensor
    # Tree node ending the locked prefix (None for ChunkCache).
    last_node: Any


@dataclass
class MatchResult:
    """The longest cached prefix of a key.

    ``device_indices`` is read-only: it may share storage with the cache's own
    tensors, so copy it before changing it in place.
    """

    # int64 KV slot indices, one per matched token, in key order.
    device_indices: torch.Tensor
    # Node where the match ends; pass it to inc_lock_ref/dec_lock_ref. None when
    # the cache stores nothing (ChunkCache).
    last_node: Any

    @property
    def prefix_len(self) -> int:
        """Number of matched tokens."""
        return int(self.device_indices.numel())


def kv_token_ids(req: PrefixCacheReq) -> list[int]:
    """The tokens of ``req`` that hold KV slots in its ``req_to_token`` row.

    Once a token has been sampled, every token but the last has KV (the last was
    never fed to the model). Before that, the request is still in (chunked)
    prefill and exactly ``fill_ids`` have slots, e.g. when it is aborted there.
    """
    if req.output_ids:
        return (req.origin_input_ids + req.output_ids)[:-1]
    return req.fill_ids


class BasePrefixCache(ABC):
    """Abstract prefix cache over the request and KV slot pools."""

    # True when the cache never reuses prefixes (``--disable-radix-cache``); the
    # scheduler uses it to skip prefix-aware policies such as LPM.
    disabled: bool = False
    # Tokens per KV page; matches and stored prefixes are multiples of it.
    page_size: int = 1

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Finds the longest cached prefix of ``key`` (page-aligned).

        Args:
            key: token ids.

        Returns:
            The matched KV slots and the node to lock while they are used.
        """

    def prefix_hint(self, key: list[int], namespace: int | None = None) -> MatchResult:
        """The match admission ordering looks at (LPM and similar policies): like
        ``match_prefix`` but without side effects beyond it; a hierarchical cache loads
        nothing back for it."""
        if namespace is None:
            return self.match_prefix(key)
        return self.match_prefix(key, namespace=namespace)  # type: ignore[call-arg]

    def note_admitted(self) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Called by the scheduler when the request of the latest ``match_prefix`` is admitted:
        a cache that counts hits counts that match now, so a request matched again at every
        admission attempt while it waits counts once."""

    def ready_for_forward(self) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Called before a prefill forward: KV the cache is still copying into the device pool
        for the batch (a hierarchical cache's loads) must be ordered before it."""

    def stats(self) -> dict[str, Any]:
        """Counters for ``/get_server_info`` and ``/metrics`` (none by default)."""
        return {}

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Stores ``value`` (KV slots, one per token of ``key``) under ``key``.

        The cache takes ownership of the slots ``value[returned:]``; the slots
        ``value[:returned]`` duplicate what was already cached and stay with the
        caller, who must free the ones it owns.

        Returns:
            Length of the prefix of ``key`` that was already in the cache.
        """

    @abstractmethod
    def cache_finished_req(self, req: PrefixCacheReq, is_insert: bool = True) -> None:
        """Releases a finished request: caches its KV (unless ``is_insert`` is False,
        as for aborted requests), frees what is not cached, frees its request slot
        and unlocks its prefix. ``kv_token_ids(req)`` says which tokens have KV."""

    @abstractmethod
    def cache_unfinished_req(self, req: PrefixCacheReq) -> None:
        """Caches the KV of ``req.fill_ids`` after a prefill chunk and moves the
        request's lock and ``prefix_indices`` to the newly cached prefix."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Frees at least ``num_tokens`` cached, unlocked tokens when possible.

        Returns:
            Number of tokens actually evicted (may be more, by up to one node,
            or less when too little is evictable).
        """

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> int:
        """Protects the path from ``node`` to the root from eviction.

        Returns:
            Change of ``evictable_size()`` (zero or negative).
        """

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> int:
        """Undoes one ``inc_lock_ref(node)``.

        Returns:
            Change of ``evictable_size()`` (zero or positive).
        """

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens that no running request holds."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens held (locked) by running requests."""

    @abstractmethod
    def total_size(self) -> int:
        """All cached tokens; equals ``evictable_size() + protected_size()``."""

    @abstractmethod
    def reset(self) -> None:
        """Forgets every cached prefix without touching the pools (the caller
        clears the pools at the same time)."""

    @abstractmethod
    def pretty_print(self) -> str:
        """A human-readable dump of the cache for debugging."""
