"""KV memory pools and the prefix caches built on them."""

from __future__ import annotations

from engine.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    MatchResult,
    PrefixCacheReq,
    kv_token_ids,
)
from engine.mem_cache.chunk_cache import ChunkCache
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from engine.mem_cache.radix_cache import RadixCache, TreeNode

__all__ = [
    "BasePrefixCache",
    "ChunkCache",
    "MatchResult",
    "MHATokenToKVPool",
    "PrefixCacheReq",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "kv_token_ids",
]
