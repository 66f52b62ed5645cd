"""ChunkCache: the radix-cache-disabled cache frees everything and matches nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from engine.mem_cache import ChunkCache, ReqToTokenPool, TokenToKVPoolAllocator


@dataclass
class FakeReq:
    """Stand-in for the scheduler's Req with exactly the fields the cache uses."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


SIZE = 64


def make_cache(page_size: int) -> tuple[ChunkCache, ReqToTokenPool, TokenToKVPoolAllocator]:
    req_pool = ReqToTokenPool(4, 64, "cpu")
    allocator = TokenToKVPoolAllocator(SIZE, page_size, "cpu")
    return ChunkCache(req_pool, allocator, page_size), req_pool, allocator


def run_chunk(
    req_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, req: FakeReq, end: int
) -> None:
    """Allocates KV for ``req``'s positions after its prefix up to ``end``."""
    assert req.req_pool_idx is not None
    start = len(req.prefix_indices)
    row = req_pool.req_to_token[req.req_pool_idx]
    slots = allocator.alloc_extend([start], [end], [int(row[start - 1]) if start else 0])
    assert slots is not None
    req_pool.write(req.req_pool_idx, start, slots)
    req.fill_ids = (req.origin_input_ids + req.output_ids)[:end]


def test_matches_nothing_and_holds_nothing() -> None:
    cache, _, _ = make_cache(1)
    result = cache.match_prefix([1, 2, 3])
    assert result.prefix_len == 0 and result.last_node is None
    assert result.device_indices.dtype == torch.int64
    assert cache.disabled
    assert cache.evict(100) == 0
    assert cache.inc_lock_ref(None) == 0 and cache.dec_lock_ref(None) == 0
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    cache.reset()
    assert "ChunkCache" in cache.pretty_print()


def test_insert_is_refused_rather_than_leaking() -> None:
    cache, _, _ = make_cache(1)
    with pytest.raises(NotImplementedError, match="radix cache disabled"):
        cache.insert([1, 2], torch.tensor([1, 2]))


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_then_finish_frees_everything(page_size: int) -> None:
    cache, req_pool, allocator = make_cache(page_size)
    req = FakeReq("a", list(range(100, 111)))
    (req.req_pool_idx,) = req_pool.alloc(1) or [None]
    req.prefix_indices = cache.match_prefix(req.origin_input_ids).device_indices
    run_chunk(req_pool, allocator, req, 5)
    cache.cache_unfinished_req(req)
    row = req_pool.req_to_token[req.req_pool_idx]
    assert req.prefix_indices.dtype == torch.int64
    assert req.prefix_indices.tolist() == row[:5].tolist()
    run_chunk(req_pool, allocator, req, 11)
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == row[:11].tolist()
    req.output_ids = [7]
    run_chunk(req_pool, allocator, req, 12)
    req.output_ids.append(8)
    assert allocator.available_size() < SIZE
    cache.cache_finished_req(req)
    assert allocator.available_size() == SIZE
    assert sorted(allocator.free_pages.tolist()) == list(range(1, SIZE // page_size + 1))
    assert req_pool.available_size() == 4


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_before_any_sample_frees_filled_slots(page_size: int) -> None:
    cache, req_pool, allocator = make_cache(page_size)
    req = FakeReq("a", list(range(20)))
    (req.req_pool_idx,) = req_pool.alloc(1) or [None]
    run_chunk(req_pool, allocator, req, 6)
    cache.cache_finished_req(req, is_insert=False)
    assert allocator.available_size() == SIZE
    assert req_pool.available_size() == 4
