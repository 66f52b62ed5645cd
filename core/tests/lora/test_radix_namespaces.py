"""The radix cache's namespaces (one per LoRA adapter load): prefixes never cross them, eviction
spans them, and an unloaded adapter's namespace is dropped with its KV freed."""

from __future__ import annotations

import torch

from engine.mem_cache import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator


def _cache(page_size: int = 1) -> tuple[RadixCache, TokenToKVPoolAllocator]:
    allocator = TokenToKVPoolAllocator(64, page_size, "cpu")
    return RadixCache(ReqToTokenPool(4, 32, "cpu"), allocator, page_size), allocator


def _slots(allocator: TokenToKVPoolAllocator, n: int) -> torch.Tensor:
    out = allocator.alloc(n)
    assert out is not None
    return out


def test_prefixes_stay_in_their_namespace() -> None:
    cache, allocator = _cache()
    key = [1, 2, 3, 4, 5, 6]
    assert cache.insert(key, _slots(allocator, 6), namespace=7) == 0
    assert len(cache.match_prefix(key).device_indices) == 0, "the base model matched an adapter's prefix"
    assert len(cache.match_prefix(key, namespace=8).device_indices) == 0, "another adapter matched it"
    match = cache.match_prefix(key[:4], namespace=7)
    assert len(match.device_indices) == 4
    # The same tokens for the base model are stored apart (no slot shared).
    base = _slots(allocator, 6)
    assert cache.insert(key, base) == 0
    assert set(cache.match_prefix(key).device_indices.tolist()) == set(base.tolist())
    assert cache.total_size() == 12 and cache.evictable_size() == 12


def test_locks_eviction_and_drop() -> None:
    cache, allocator = _cache()
    free_at_start = allocator.available_size()
    cache.insert([1, 2, 3], _slots(allocator, 3), namespace=1)
    cache.insert([4, 5], _slots(allocator, 2), namespace=2)
    match = cache.match_prefix([1, 2, 3], namespace=1)
    cache.inc_lock_ref(match.last_node)
    assert cache.protected_size() == 3 and cache.evict(10) == 2, "only namespace 2's unlocked leaf goes"
    cache.dec_lock_ref(match.last_node)
    assert cache.protected_size() == 0
    assert cache.drop_namespace(1) == 3 and cache.total_size() == 0
    assert allocator.available_size() == free_at_start
    assert cache.drop_namespace(1) == 0
    assert len(cache.match_prefix([1, 2, 3], namespace=1).device_indices) == 0
