"""RadixCache: matching, splitting, eviction, locking, request integration and a
property-based test of its accounting against the real pools."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import ConfigError
from engine.mem_cache import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator, TreeNode
from engine.mem_cache.radix_cache import _common_prefix_len


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


def make_cache(
    size: int = 64, page_size: int = 1, policy: str = "lru", reqs: int = 4, ctx: int = 64
) -> tuple[RadixCache, ReqToTokenPool, TokenToKVPoolAllocator]:
    req_pool = ReqToTokenPool(reqs, ctx, "cpu")
    allocator = TokenToKVPoolAllocator(size, page_size, "cpu")
    return RadixCache(req_pool, allocator, page_size, policy), req_pool, allocator


def insert_fresh(
    cache: RadixCache, allocator: TokenToKVPoolAllocator, key: list[int]
) -> torch.Tensor:
    """Inserts ``key`` with newly allocated slots, freeing the duplicates as a caller must."""
    value = allocator.alloc(len(key))
    assert value is not None
    prefix = cache.insert(key, value)
    allocator.free(value[:prefix])
    return value


def check_sizes(cache: RadixCache) -> None:
    total = sum(len(node.value) for node in cache._nodes())
    assert cache.evictable_size() + cache.protected_size() == cache.total_size() == total
    assert len(cache.all_values_flatten()) == total


# -- matching and inserting -------------------------------------------------
def test_match_on_empty_tree() -> None:
    cache, _, _ = make_cache()
    for key in ([], [1, 2, 3]):
        result = cache.match_prefix(key)
        assert result.prefix_len == 0
        assert result.device_indices.dtype == torch.int64
        assert result.last_node is cache.root_node
    assert cache.total_size() == 0


def test_tuple_keys_behave_like_lists() -> None:
    cache, _, _ = make_cache()
    cache.insert((1, 2, 3), torch.tensor([4, 5, 6]))
    assert cache.match_prefix([1, 2, 3]).prefix_len == 3
    assert cache.insert([1, 2, 3, 4], torch.tensor([4, 5, 6, 7])) == 3
    assert cache.match_prefix((1, 2, 3, 4)).device_indices.tolist() == [4, 5, 6, 7]


def test_insert_match_round_trip() -> None:
    cache, _, allocator = make_cache()
    value = insert_fresh(cache, allocator, [1, 2, 3, 4, 5])
    assert cache.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == value.tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).device_indices.tolist() == value.tolist()
    assert cache.match_prefix([1, 2, 9]).device_indices.tolist() == value[:2].tolist()
    assert cache.match_prefix([2, 1]).prefix_len == 0
    # Re-inserting reports the cached length and keeps the original slots.
    again = torch.tensor([50, 51, 52, 53, 54, 55])
    assert cache.insert([1, 2, 3, 4, 5, 6], again) == 5
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == value.tolist() + [55]
    assert cache.total_size() == 6
    check_sizes(cache)


def test_insert_copies_value_so_caller_can_reuse_its_tensor() -> None:
    cache, _, _ = make_cache()
    for dtype in (torch.int32, torch.int64):
        cache.reset()
        value = torch.tensor([10, 11, 12], dtype=dtype)
        cache.insert([1, 2, 3], value)
        value.fill_(0)
        result = cache.match_prefix([1, 2, 3]).device_indices
        assert result.dtype == torch.int64 and result.tolist() == [10, 11, 12]


def test_split_in_middle_of_edge_keeps_both_halves_correct() -> None:
    cache, _, allocator = make_cache()
    value = insert_fresh(cache, allocator, [1, 2, 3, 4, 5, 6])
    result = cache.match_prefix([1, 2, 3, 7])
    assert result.device_indices.tolist() == value[:3].tolist()
    upper = result.last_node
    assert upper.key == [1, 2, 3] and upper.value.tolist() == value[:3].tolist()
    (lower,) = upper.children.values()
    assert lower.key == [4, 5, 6] and lower.value.tolist() == value[3:].tolist()
    assert lower.parent is upper and upper.parent is cache.root_node
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == value.tolist()
    check_sizes(cache)
    # A branch off the split point shares the upper half only.
    other = insert_fresh(cache, allocator, [1, 2, 3, 8, 9])
    assert sorted(upper.children) == [4, 8]
    assert cache.match_prefix([1, 2, 3, 8, 9]).device_indices.tolist() == (
        value[:3].tolist() + other[3:].tolist()
    )
    assert cache.total_size() == 8
    check_sizes(cache)


def test_insert_splits_edge_on_partial_match() -> None:
    cache, _, allocator = make_cache()
    insert_fresh(cache, allocator, [1, 2, 3, 4])
    assert cache.insert([1, 2, 9], torch.tensor([40, 41, 42])) == 2
    (upper,) = cache.root_node.children.values()
    assert upper.key == [1, 2] and len(upper.children) == 2
    assert cache.match_prefix([1, 2, 9]).device_indices.tolist()[2] == 42


def test_common_prefix_len_finds_every_mismatch_position() -> None:
    edge = list(range(1000))
    for cut in range(1000):
        probe = edge[:cut] + [-1] + edge[cut + 1 :]
        assert _common_prefix_len(edge, probe, 0) == cut
        assert _common_prefix_len(edge, [7, 7] + probe[: cut + 1], 2) == cut
    assert _common_prefix_len(edge, edge + [1], 0) == 1000
    assert _common_prefix_len(edge, edge[:300], 0) == 300


def test_long_edge_match_then_split() -> None:
    cache, _, _ = make_cache(size=4096)
    key = list(range(1000))
    cache.insert(key, torch.arange(1, 1001))
    assert cache.match_prefix(key[:500] + [-1]).prefix_len == 500
    assert cache.match_prefix(key + [5]).device_indices.tolist() == list(range(1, 1001))


# -- eviction ---------------------------------------------------------------
def _lru_vs_lfu_setup(policy: str) -> tuple[RadixCache, TokenToKVPoolAllocator]:
    cache, _, allocator = make_cache(policy=policy)
    insert_fresh(cache, allocator, [1, 1, 1])
    insert_fresh(cache, allocator, [2, 2, 2])
    cache.match_prefix([1, 1, 1])
    cache.match_prefix([1, 1, 1])
    cache.match_prefix([2, 2, 2])  # [2...] is more recent but used less often
    return cache, allocator


def test_lru_evicts_least_recently_used_leaf() -> None:
    cache, _ = _lru_vs_lfu_setup("lru")
    assert cache.evict(1) == 3
    assert cache.match_prefix([1, 1, 1]).prefix_len == 0
    assert cache.match_prefix([2, 2, 2]).prefix_len == 3


def test_lfu_evicts_least_frequently_used_leaf() -> None:
    cache, _ = _lru_vs_lfu_setup("lfu")
    assert cache.evict(1) == 3
    assert cache.match_prefix([2, 2, 2]).prefix_len == 0
    assert cache.match_prefix([1, 1, 1]).prefix_len == 3


def test_lfu_breaks_ties_by_lru() -> None:
    cache, _, allocator = make_cache(policy="lfu")
    insert_fresh(cache, allocator, [1, 1])
    insert_fresh(cache, allocator, [2, 2])
    cache.match_prefix([2, 2])
    cache.match_prefix([1, 1])  # equal hits; [2, 2] is older
    cache.evict(1)
    assert cache.match_prefix([2, 2]).prefix_len == 0
    assert cache.match_prefix([1, 1]).prefix_len == 2


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ConfigError, match="lru, lfu"):
        make_cache(policy="fifo")
    with pytest.raises(ConfigError, match="allocator's page_size 4"):
        RadixCache(ReqToTokenPool(1, 8, "cpu"), TokenToKVPoolAllocator(16, 4), page_size=1)


def test_evict_frees_exactly_the_evicted_slots() -> None:
    cache, _, allocator = make_cache(size=16)
    first = insert_fresh(cache, allocator, [1, 2, 3, 4])
    insert_fresh(cache, allocator, [5, 6, 7, 8])
    cache.match_prefix([5, 6, 7, 8])  # [1..4] is now the LRU leaf
    free_before = allocator.free_pages.tolist()
    assert cache.evict(2) == 4  # whole leaves only
    assert allocator.free_pages.tolist() == free_before + first.tolist()
    assert cache.total_size() == 4
    check_sizes(cache)


def test_evict_makes_parents_leaves() -> None:
    cache, _, allocator = make_cache(size=16)
    insert_fresh(cache, allocator, [1, 2, 3, 4])
    insert_fresh(cache, allocator, [1, 2, 5, 6])
    assert cache.total_size() == 6
    assert cache.evict(6) == 6
    assert cache.total_size() == 0 and not cache.root_node.children
    assert allocator.available_size() == 16
    assert sorted(allocator.free_pages.tolist()) == list(range(1, 17))


def test_locked_nodes_are_never_evicted() -> None:
    cache, _, allocator = make_cache()
    locked = insert_fresh(cache, allocator, [1, 2, 3, 4])
    insert_fresh(cache, allocator, [7, 8])
    result = cache.match_prefix([1, 2])  # split: only [1, 2] gets locked
    assert cache.inc_lock_ref(result.last_node) == -2
    assert cache.protected_size() == 2 and cache.evictable_size() == 4
    assert cache.inc_lock_ref(result.last_node) == 0  # second holder moves nothing
    assert cache.evict(100) == 4
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == locked[:2].tolist()
    assert cache.evictable_size() == 0 and cache.protected_size() == 2
    assert cache.dec_lock_ref(result.last_node) == 0
    assert cache.dec_lock_ref(result.last_node) == 2
    with pytest.raises(RuntimeError, match="unbalanced"):
        cache.dec_lock_ref(result.last_node)
    assert cache.evict(100) == 2 and cache.total_size() == 0


def test_lock_of_root_or_none_is_noop() -> None:
    cache, _, _ = make_cache()
    assert cache.inc_lock_ref(cache.root_node) == 0
    assert cache.dec_lock_ref(None) == 0


def test_reset_empties_tree_without_touching_pools() -> None:
    cache, _, allocator = make_cache()
    insert_fresh(cache, allocator, [1, 2, 3])
    cache.reset()
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    assert cache.match_prefix([1, 2, 3]).prefix_len == 0
    assert allocator.available_size() == 61


def test_pretty_print_shows_nodes() -> None:
    cache, _, allocator = make_cache()
    insert_fresh(cache, allocator, [1, 2, 3])
    insert_fresh(cache, allocator, [1, 2, 4])
    text = cache.pretty_print()
    assert "[1, 2] len=2" in text and "  [3] len=1" in text


# -- pages ------------------------------------------------------------------
def test_page_size_4_caches_whole_pages_only() -> None:
    cache, _, allocator = make_cache(page_size=4)
    key = list(range(10))
    value = allocator.alloc(12)
    assert value is not None
    assert cache.insert(key, value[:10]) == 0
    assert cache.total_size() == 8  # the partial third page is left to the caller
    assert cache.match_prefix(key).device_indices.tolist() == value[:8].tolist()
    # A mismatch inside the second page matches only the first page.
    assert cache.match_prefix([0, 1, 2, 3, 4, 99, 6, 7]).prefix_len == 4
    assert cache.match_prefix([0, 1, 2]).prefix_len == 0
    # Inserting the diverging key splits at the page boundary.
    other = torch.arange(100, 108)
    assert cache.insert([0, 1, 2, 3, 4, 99, 6, 7], other) == 4
    (upper,) = cache.root_node.children.values()
    assert upper.key == [0, 1, 2, 3]
    assert sorted(upper.children) == [(4, 5, 6, 7), (4, 99, 6, 7)]
    assert cache.match_prefix([0, 1, 2, 3, 4, 99, 6, 7, 8]).device_indices.tolist() == (
        value[:4].tolist() + other[4:].tolist()
    )
    for node in [upper, *upper.children.values()]:
        assert len(node.key) % 4 == 0 and len(node.value) == len(node.key)
    check_sizes(cache)


# -- request integration ----------------------------------------------------
def admit(cache: RadixCache, req_pool: ReqToTokenPool, req: FakeReq) -> None:
    """What the scheduler does when it admits a request: slot, match, lock, write."""
    slots = req_pool.alloc(1)
    assert slots is not None
    req.req_pool_idx = slots[0]
    result = cache.match_prefix(req.origin_input_ids[:-1])
    req.prefix_indices = result.device_indices
    req.last_node = result.last_node
    cache.inc_lock_ref(result.last_node)
    req_pool.write(req.req_pool_idx, 0, result.device_indices)


def extend(
    allocator: TokenToKVPoolAllocator, req_pool: ReqToTokenPool, req: FakeReq, end: int
) -> None:
    """Allocates KV for positions ``len(req.fill_ids)..end`` (one prefill chunk or decode)."""
    assert req.req_pool_idx is not None
    row = req_pool.req_to_token[req.req_pool_idx]
    start = len(req.fill_ids) if req.fill_ids else len(req.prefix_indices)
    last_loc = int(row[start - 1]) if start else 0
    slots = allocator.alloc_extend([start], [end], [last_loc])
    assert slots is not None
    req_pool.write(req.req_pool_idx, start, slots)
    req.fill_ids = (req.origin_input_ids + req.output_ids)[:end]


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_finished_req_reuses_and_frees(page_size: int) -> None:
    cache, req_pool, allocator = make_cache(size=64, page_size=page_size)
    prompt = list(range(100, 110))
    first = FakeReq("a", prompt)
    admit(cache, req_pool, first)
    extend(allocator, req_pool, first, 10)
    first.output_ids = [7]  # prefill sampled one token
    extend(allocator, req_pool, first, 11)  # one decode step
    first.output_ids.append(8)
    cache.cache_finished_req(first)
    cached = 11 // page_size * page_size
    assert cache.total_size() == cached and cache.protected_size() == 0
    assert allocator.available_size() == 64 - cached
    assert req_pool.available_size() == 4

    second = FakeReq("b", prompt + [7, 5, 6])  # shares the 11 tokens with KV
    admit(cache, req_pool, second)
    assert len(second.prefix_indices) == cached
    assert cache.protected_size() == len(second.prefix_indices)
    extend(allocator, req_pool, second, 13)
    second.output_ids = [9]
    cache.cache_finished_req(second)
    assert cache.protected_size() == 0
    assert cache.total_size() + allocator.available_size() == 64
    check_sizes(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_aborted_request_frees_everything_past_prefix(page_size: int) -> None:
    cache, req_pool, allocator = make_cache(size=64, page_size=page_size)
    insert_fresh(cache, allocator, [1, 2, 3, 4])
    req = FakeReq("a", [1, 2, 3, 4, 5, 6, 7])
    admit(cache, req_pool, req)
    extend(allocator, req_pool, req, 7)
    req.output_ids = [8]
    cache.cache_finished_req(req, is_insert=False)
    assert cache.total_size() == 4 and cache.protected_size() == 0
    assert allocator.available_size() == 60
    assert req_pool.available_size() == 4


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_with_concurrent_duplicate(page_size: int) -> None:
    """Two requests prefill the same 10-token prefix in chunks of 5; the second
    one's duplicate slots are freed and its row is pointed at the tree's slots."""
    size = 64
    cache, req_pool, allocator = make_cache(size=size, page_size=page_size)
    shared = list(range(1, 11))
    a, b = FakeReq("a", shared + [20, 21, 22]), FakeReq("b", shared + [30, 31])
    for req in (a, b):
        admit(cache, req_pool, req)
        extend(allocator, req_pool, req, 5)
    for req in (a, b):
        cache.cache_unfinished_req(req)
        assert len(req.prefix_indices) == 5
        row = req_pool.req_to_token[req.req_pool_idx, :5].to(torch.int64)
        assert req.prefix_indices.tolist() == row.tolist()
    aligned = 5 // page_size * page_size
    assert cache.total_size() == aligned
    assert req_pool.req_to_token[b.req_pool_idx, :aligned].tolist() == (
        req_pool.req_to_token[a.req_pool_idx, :aligned].tolist()
    )
    assert cache.protected_size() == aligned
    for req in (a, b):
        extend(allocator, req_pool, req, 10)
        cache.cache_unfinished_req(req)
    assert cache.total_size() == 10 // page_size * page_size
    for req in (a, b):
        extend(allocator, req_pool, req, len(req.origin_input_ids))
        req.output_ids = [99]
        cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    assert cache.total_size() + allocator.available_size() == size
    assert sorted(cache.all_values_flatten().tolist() + _free_slots(allocator)) == list(
        range(page_size, size + page_size)
    )
    check_sizes(cache)


def test_unaligned_tail_page_replaced_by_tree_page() -> None:
    """Page 4: ``a`` has a 2-token tail page when ``b`` caches that page; at
    ``a``'s next chunk its copy is freed and its row must point at ``b``'s page."""
    cache, req_pool, allocator = make_cache(size=64, page_size=4)
    prompt = list(range(1, 17))
    a, b = FakeReq("a", prompt + [50]), FakeReq("b", prompt + [60])
    admit(cache, req_pool, a)
    extend(allocator, req_pool, a, 6)
    cache.cache_unfinished_req(a)  # tree: positions 0..3; a owns 4..5
    admit(cache, req_pool, b)
    assert len(b.prefix_indices) == 4
    extend(allocator, req_pool, b, 12)
    cache.cache_unfinished_req(b)  # tree: 0..11, positions 4..7 from b
    extend(allocator, req_pool, a, 12)
    free_before = allocator.available_size()
    cache.cache_unfinished_req(a)
    assert allocator.available_size() == free_before + 8  # a's copies of 4..11
    a_row = req_pool.req_to_token[a.req_pool_idx, :12].tolist()
    b_row = req_pool.req_to_token[b.req_pool_idx, :12].tolist()
    assert a_row == b_row == a.prefix_indices.tolist()
    for req in (a, b):
        extend(allocator, req_pool, req, 17)
        req.output_ids = [1]
        cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    assert cache.total_size() + allocator.available_size() == 64


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_mid_chunked_prefill_frees_own_tail(page_size: int) -> None:
    """Aborted right after a chunk was cached, before anything was sampled: the
    KV extent is ``fill_ids`` and the request's partial tail page is freed too."""
    cache, req_pool, allocator = make_cache(size=64, page_size=page_size)
    req = FakeReq("a", list(range(1, 13)))
    admit(cache, req_pool, req)
    extend(allocator, req_pool, req, 6)
    cache.cache_unfinished_req(req)
    cache.cache_finished_req(req, is_insert=False)
    cached = 6 // page_size * page_size
    assert cache.total_size() == cached and cache.protected_size() == 0
    assert allocator.available_size() == 64 - cached
    assert req_pool.available_size() == 4


def _free_slots(allocator: TokenToKVPoolAllocator) -> list[int]:
    ps = allocator.page_size
    return [p * ps + o for p in allocator.free_pages.tolist() for o in range(ps)]


# -- property-based: random workloads against the real pools ----------------
class Workload:
    """Drives a RadixCache like a scheduler would and checks it after every op.

    ``meaning[slot]`` records which token prefix a KV slot was computed for, so
    the checks catch a slot reused for the wrong tokens, not only leaks.
    """

    SIZE, REQS, CTX = 64, 4, 64

    def __init__(self, page_size: int, policy: str) -> None:
        self.ps = page_size
        self.cache, self.req_pool, self.allocator = make_cache(
            self.SIZE, page_size, policy, self.REQS, self.CTX
        )
        self.live: list[FakeReq] = []
        self.chunk: dict[str, int] = {}
        self.held_locks: list[TreeNode] = []
        self.meaning: dict[int, tuple[int, ...]] = {}

    def _tokens(self, req: FakeReq) -> list[int]:
        return req.origin_input_ids + req.output_ids

    def _alloc(self, req: FakeReq, start: int, end: int) -> bool:
        """KV for positions start..end of ``req``, evicting once if short."""
        assert req.req_pool_idx is not None
        row = self.req_pool.req_to_token[req.req_pool_idx]
        last_loc = int(row[start - 1]) if start else 0
        slots = self.allocator.alloc_extend([start], [end], [last_loc])
        if slots is None:
            self.cache.evict(end - start + self.ps)
            slots = self.allocator.alloc_extend([start], [end], [last_loc])
        if slots is None:
            return False
        self.req_pool.write(req.req_pool_idx, start, slots)
        tokens = self._tokens(req)
        for pos, slot in zip(range(start, end), slots.tolist()):
            self.meaning[slot] = tuple(tokens[: pos + 1])
        return True

    # -- operations -------------------------------------------------------
    def start(self, tokens: list[int], chunk: int) -> None:
        if not tokens or len(self.live) == self.REQS:
            return
        req = FakeReq(f"r{len(self.meaning)}-{len(self.live)}", list(tokens))
        admit(self.cache, self.req_pool, req)
        self._check_match(req.origin_input_ids[:-1], req.prefix_indices)
        end = min(len(tokens), len(req.prefix_indices) + chunk)
        if not self._alloc(req, len(req.prefix_indices), end):
            # Admission failed: give back what admit() took.
            self.cache.dec_lock_ref(req.last_node)
            self.req_pool.free(req.req_pool_idx)
            return
        req.fill_ids = tokens[:end]
        self.chunk[req.rid] = chunk
        self.live.append(req)

    def step(self, index: int, token: int) -> None:
        if not self.live:
            return
        req = self.live[index % len(self.live)]
        done = len(req.fill_ids)
        if done < len(req.origin_input_ids):  # chunked prefill continues
            self.cache.cache_unfinished_req(req)
            assert len(req.prefix_indices) == done
            row = self.req_pool.req_to_token[req.req_pool_idx, :done]
            assert req.prefix_indices.tolist() == row.tolist()
            end = min(len(req.origin_input_ids), done + self.chunk[req.rid])
            if self._alloc(req, done, end):
                req.fill_ids = req.origin_input_ids[:end]
        elif not req.output_ids:
            req.output_ids.append(token)  # prefill's sample; no KV for it yet
        elif len(self._tokens(req)) < self.CTX:  # decode the last token
            kv_len = len(self._tokens(req)) - 1
            if self._alloc(req, kv_len, kv_len + 1):
                req.output_ids.append(token)
                req.fill_ids = self._tokens(req)[: kv_len + 1]

    def finish(self, index: int, is_insert: bool) -> None:
        """Finishes (or aborts, even mid-prefill) a live request."""
        if not self.live:
            return
        req = self.live.pop(index % len(self.live))
        self.cache.cache_finished_req(req, is_insert=is_insert)

    def insert(self, tokens: list[int]) -> None:
        key = tokens[: len(tokens) // self.ps * self.ps]
        if not key:
            return
        value = self.allocator.alloc(len(key))
        if value is None:
            return
        for pos, slot in enumerate(value.tolist()):
            self.meaning[slot] = tuple(key[: pos + 1])
        prefix = self.cache.insert(key, value)
        self.allocator.free(value[:prefix])

    def match(self, tokens: list[int], lock: bool) -> None:
        result = self.cache.match_prefix(tokens)
        self._check_match(tokens, result.device_indices)
        if lock:
            before = self.cache.evictable_size()
            delta = self.cache.inc_lock_ref(result.last_node)
            assert self.cache.evictable_size() == before + delta and delta <= 0
            self.held_locks.append(result.last_node)

    def unlock(self, index: int) -> None:
        if self.held_locks:
            node = self.held_locks.pop(index % len(self.held_locks))
            assert self.cache.dec_lock_ref(node) >= 0

    def evict(self, num_tokens: int) -> None:
        evictable, available = self.cache.evictable_size(), self.allocator.available_size()
        evicted = self.cache.evict(num_tokens)
        assert min(num_tokens, evictable) <= evicted <= evictable
        assert self.cache.evictable_size() == evictable - evicted
        assert self.allocator.available_size() == available + evicted

    # -- checks -----------------------------------------------------------
    def _check_match(self, key: list[int], indices: torch.Tensor) -> None:
        n = len(indices)
        assert n % self.ps == 0
        for pos, slot in enumerate(indices.tolist()):
            assert self.meaning[slot] == tuple(key[: pos + 1])
        # Maximal: the next whole page of the key is not cached.
        if n + self.ps <= len(key):
            assert tuple(key[: n + self.ps]) not in self._cached_prefixes()

    def _cached_prefixes(self) -> set[tuple[int, ...]]:
        out: set[tuple[int, ...]] = set()
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(self.cache.root_node, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                path = prefix + tuple(child.key)
                out.update(path[: len(prefix) + i + 1] for i in range(len(child.key)))
                stack.append((child, path))
        return out

    def check(self) -> None:
        cache, ps = self.cache, self.ps
        nodes = list(cache._nodes())
        total = sum(len(n.value) for n in nodes)
        assert cache.evictable_size() + cache.protected_size() == cache.total_size() == total
        # Lock counts are exactly the holders whose path passes through the node.
        expected: dict[int, int] = {}
        for holder in [r.last_node for r in self.live] + self.held_locks:
            while holder is not cache.root_node:
                expected[holder.id] = expected.get(holder.id, 0) + 1
                holder = holder.parent
        assert {n.id: n.lock_ref for n in nodes if n.lock_ref} == expected
        assert cache.protected_size() == sum(len(n.key) for n in nodes if n.lock_ref)
        # Tree content: whole pages, each slot computed for its path.
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root_node, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                assert len(child.key) == len(child.value) and len(child.key) % ps == 0
                path = prefix + tuple(child.key)
                for i, slot in enumerate(child.value.tolist()):
                    assert self.meaning[slot] == path[: len(prefix) + i + 1]
                stack.append((child, path))
        # Every page is exactly once free, in the tree, or owned by a live request.
        tree_slots = cache.all_values_flatten()
        assert len(torch.unique(tree_slots)) == len(tree_slots)
        pages = [self.allocator.free_pages, torch.unique(tree_slots // ps)]
        for req in self.live:
            tokens = self._tokens(req)
            kv_len = len(req.fill_ids)
            row = self.req_pool.req_to_token[req.req_pool_idx, :kv_len].to(torch.int64)
            for pos, slot in enumerate(row.tolist()):
                assert self.meaning[slot] == tuple(tokens[: pos + 1])
            in_tree = len(req.prefix_indices) // ps * ps
            assert torch.isin(row[:in_tree], tree_slots).all()
            pages.append(torch.unique(row[in_tree:] // ps))
        all_pages = torch.sort(torch.cat(pages)).values.tolist()
        assert all_pages == list(range(1, self.SIZE // ps + 1))
        assert self.req_pool.available_size() + len(self.live) == self.REQS


# Prompts are a cut of one of a few base sequences plus a random tail, so that
# requests share prefixes, split edges and race to cache the same pages.
BASES = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [5, 6, 7, 8, 9, 10, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55],
]
tokens_st = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, len(BASES) - 1),
    st.integers(0, 16),
    st.lists(st.integers(0, 3), max_size=6),
)
index_st = st.integers(0, 3)
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("start"), tokens_st, st.integers(1, 9)),
        st.tuples(st.just("step"), index_st, st.integers(0, 3)),
        st.tuples(st.just("step"), index_st, st.integers(0, 3)),
        st.tuples(st.just("step"), index_st, st.integers(0, 3)),
        st.tuples(st.just("finish"), index_st, st.booleans()),
        st.tuples(st.just("insert"), tokens_st),
        st.tuples(st.just("match"), tokens_st, st.booleans()),
        st.tuples(st.just("unlock"), index_st),
        st.tuples(st.just("evict"), st.integers(0, 40)),
    ),
    min_size=20,
    max_size=80,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 4]), policy=st.sampled_from(["lru", "lfu"]), ops=ops_st)
def test_random_workload_keeps_accounting_exact(
    page_size: int, policy: str, ops: list[tuple[Any, ...]]
) -> None:
    work = Workload(page_size, policy)
    for op, *args in ops:
        getattr(work, op)(*args)
        work.check()
    # Releasing every holder leaves an unlocked tree; evicting it leaves no leak.
    while work.live:
        work.finish(0, True)
    while work.held_locks:
        work.unlock(0)
    work.check()
    assert work.cache.protected_size() == 0
    work.evict(work.SIZE)
    assert work.cache.total_size() == 0
    assert work.allocator.available_size() == work.SIZE
