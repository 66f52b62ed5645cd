"""The prefix cache used with ``--disable-radix-cache``: it caches nothing.

Every request computes its whole prompt; KV slots are freed as soon as the
request finishes. It still implements ``cache_unfinished_req`` because chunked
prefill needs ``req.prefix_indices`` to cover the chunks already computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    MatchResult,
    PrefixCacheReq,
    kv_token_ids,
)

if TYPE_CHECKING:
    from engine.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator


class ChunkCache(BasePrefixCache):
    """A no-op prefix cache: empty matches, KV freed at finish, no eviction."""

    disabled = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = token_to_kv_pool_allocator.device

    def reset(self) -> None:
        """Nothing is stored, so nothing to forget."""

    def match_prefix(self, key: list[int], namespace: int | None = None) -> MatchResult:
        """Always an empty match with ``last_node`` None (in any namespace)."""
        return MatchResult(
            device_indices=torch.empty(0, dtype=torch.int64, device=self.device), last_node=None
        )

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Not supported: this cache cannot take ownership of slots, and silently
        accepting them would leak them."""
        raise NotImplementedError(
            "ChunkCache stores no prefixes (radix cache disabled); insert is not supported"
        )

    def cache_finished_req(self, req: PrefixCacheReq, is_insert: bool = True) -> None:
        """Frees all the request's KV slots and its request slot (``is_insert`` is
        ignored: nothing is ever cached)."""
        assert req.req_pool_idx is not None, f"request {req.rid} holds no request slot"
        kv_len = len(kv_token_ids(req))
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv_len]
        self.token_to_kv_pool_allocator.free(kv.to(torch.int64))
        self.req_to_token_pool.free(req.req_pool_idx)

    def cache_unfinished_req(self, req: PrefixCacheReq) -> None:
        """Marks every computed token as the request's prefix for its next chunk."""
        assert req.req_pool_idx is not None, f"request {req.rid} holds no request slot"
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.fill_ids)]
        req.prefix_indices = kv.to(torch.int64)

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> int:
        return 0

    def dec_lock_ref(self, node: Any) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def pretty_print(self) -> str:
        return "ChunkCache(radix cache disabled; nothing cached)"
