"""HiRadixCache: device eviction into a host tier, load-back on match, tier LRU, adoption of
tier-only nodes on insert, namespaces, and the accounting of both pools under random work.

The KV pool's K buffer holds each token's id at its slot (V its negation), so a load-back is
checked by reading the slots a match returns.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine.errors import ConfigError
from engine.mem_cache import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from engine.mem_cache.hiradix_cache import HiRadixCache
from engine.mem_cache.kv_tier import HostMemoryTier, KvLayout


def make_cache(size: int = 32, tier_tokens: int = 64, page_size: int = 1,
               policy: str = "write_back") -> tuple[HiRadixCache, TokenToKVPoolAllocator, MHATokenToKVPool]:
    pool = MHATokenToKVPool(size, page_size, torch.float32, 1, 2, 2, "cpu")
    allocator = TokenToKVPoolAllocator(size, page_size, "cpu")
    layout = KvLayout(num_layers=2, num_kv_heads=1, head_dim=2, v_head_dim=2, dtype=torch.float32,
                      page_size=page_size)
    tier = HostMemoryTier(layout, tier_tokens)
    cache = HiRadixCache(ReqToTokenPool(4, 64, "cpu"), allocator, pool, tier, page_size=page_size,
                         write_policy=policy)
    return cache, allocator, pool


def put(cache: HiRadixCache, allocator: TokenToKVPoolAllocator, pool: MHATokenToKVPool, key: list[int]) -> None:
    """Computes ``key``'s "KV" into fresh slots (evicting as the scheduler would) and inserts it."""
    if allocator.available_size() < len(key):
        cache.evict(len(key) - allocator.available_size())
    slots = allocator.alloc(len(key))
    assert slots is not None
    for layer in range(pool.num_layers):
        pool.k_buffer[layer][slots] = torch.tensor(key, dtype=torch.float32)[:, None, None].expand(-1, 1, 2)
        pool.v_buffer[layer][slots] = -pool.k_buffer[layer][slots]
    prefix = cache.insert(key, slots)
    allocator.free(slots[:prefix])


def kv_tokens(pool: MHATokenToKVPool, slots: torch.Tensor) -> list[int]:
    """The token ids stored at ``slots`` (every layer, K and V must agree)."""
    ids = pool.k_buffer[0][slots][:, 0, 0]
    for layer in range(pool.num_layers):
        assert torch.equal(pool.k_buffer[layer][slots][:, 0, 0], ids)
        assert torch.equal(pool.v_buffer[layer][slots][:, 0, 1], -ids)
    return [int(x) for x in ids]


def check_invariants(cache: HiRadixCache, allocator: TokenToKVPoolAllocator) -> None:
    device = tier = 0
    for node in cache._nodes():
        assert node.value is not None or node.host_value is not None, "a node with no copy"
        if node.value is not None:
            device += len(node.key)
            assert node.parent is cache.root_node or node.parent.value is not None, "device nodes not top-closed"
        if node.host_value is not None:
            tier += len(node.key)
    assert cache.evictable_size() + cache.protected_size() == cache.total_size() == device
    assert allocator.available_size() + device == allocator.size
    assert cache.host_size() == tier


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_evicted_prefix_comes_back_from_host(policy: str) -> None:
    cache, allocator, pool = make_cache(policy=policy)
    a, b = list(range(100, 120)), list(range(200, 220))
    put(cache, allocator, pool, a)
    put(cache, allocator, pool, b)  # the 32-slot pool cannot hold both: a goes to the host
    check_invariants(cache, allocator)
    assert cache.match_prefix(a, load_back=False).prefix_len == 0
    match = cache.match_prefix(a + [1, 2])
    assert match.prefix_len == 20 and kv_tokens(pool, match.device_indices) == a
    assert cache.stats()["hicache_bytes_loaded"] == 20 * 32
    assert cache.host_hit_tokens == 0  # counted when its request is admitted
    # Not admitted this round: matched again at the next attempt, now on the device, it is still
    # the same host hit, counted once.
    cache.match_prefix(a + [1, 2])
    cache.note_admitted()
    assert (cache.lookup_tokens, cache.device_hit_tokens, cache.host_hit_tokens) == (22, 0, 20)
    cache.match_prefix(a + [3])
    cache.note_admitted()
    assert (cache.lookup_tokens, cache.device_hit_tokens, cache.host_hit_tokens) == (43, 20, 20)
    check_invariants(cache, allocator)
    # b went to the host in turn and is served from there too.
    assert kv_tokens(pool, cache.match_prefix(b).device_indices) == b


def test_write_policies_differ_in_when_they_copy() -> None:
    for policy, written_after_insert in (("write_through", 10), ("write_back", 0)):
        cache, allocator, pool = make_cache(policy=policy)
        put(cache, allocator, pool, list(range(10, 20)))
        assert cache.transfer.tokens_written == written_after_insert
        cache.evict(10)
        assert cache.transfer.tokens_written == 10  # write-through does not copy twice
        check_invariants(cache, allocator)


def test_tier_evicts_least_recently_used_leaves() -> None:
    cache, allocator, pool = make_cache(size=16, tier_tokens=24)
    keys = [list(range(s, s + 12)) for s in (100, 200, 300, 400)]
    for key in keys:
        put(cache, allocator, pool, key)
    # Pool 16 holds one key, the tier two: the oldest key left the tree altogether.
    assert cache.match_prefix(keys[0], load_back=False).prefix_len == 0
    assert all(not n.key or n.key[0] != 100 for n in cache._nodes())
    assert kv_tokens(pool, cache.match_prefix(keys[1]).device_indices) == keys[1]
    check_invariants(cache, allocator)


def test_dropped_when_the_tier_has_no_room() -> None:
    cache, allocator, pool = make_cache(size=16, tier_tokens=8)
    put(cache, allocator, pool, list(range(100, 112)))
    put(cache, allocator, pool, list(range(200, 212)))
    assert cache.dropped_tokens == 12 and cache.host_size() == 0
    check_invariants(cache, allocator)


def test_insert_over_a_tier_only_node_adopts_the_callers_slots() -> None:
    cache, allocator, pool = make_cache()
    a = list(range(100, 120))
    put(cache, allocator, pool, a)
    cache.evict(20)
    slots = allocator.alloc(24)
    assert slots is not None
    # Recomputed without loading back: the tree takes the caller's slots for the tier-only part.
    assert cache.insert(a + [7, 8, 9, 10], slots) == 0
    assert torch.equal(cache.match_prefix(a + [7, 8, 9, 10]).device_indices, slots)
    check_invariants(cache, allocator)


def test_partial_match_splits_a_tier_only_node() -> None:
    cache, allocator, pool = make_cache(page_size=4)
    a = list(range(100, 124))
    put(cache, allocator, pool, a)
    cache.evict(24)
    match = cache.match_prefix(a[:10] + [1, 2, 3])  # page-aligned: 8 tokens
    assert match.prefix_len == 8 and kv_tokens(pool, match.device_indices) == a[:8]
    assert kv_tokens(pool, cache.match_prefix(a).device_indices) == a
    check_invariants(cache, allocator)


def test_locked_prefix_survives_the_load_of_another() -> None:
    cache, allocator, pool = make_cache(size=24)
    a, b = list(range(100, 116)), list(range(200, 216))
    put(cache, allocator, pool, a)
    put(cache, allocator, pool, b)
    held = cache.match_prefix(b)
    cache.inc_lock_ref(held.last_node)
    # a needs 16 slots; only 8 are free and b is locked: a stays in the tier.
    assert cache.match_prefix(a).prefix_len == 0
    cache.dec_lock_ref(held.last_node)
    assert kv_tokens(pool, cache.match_prefix(a).device_indices) == a
    check_invariants(cache, allocator)


def test_drop_namespace_and_reset_free_both_tiers() -> None:
    cache, allocator, pool = make_cache()
    slots = allocator.alloc(20)
    cache.insert(list(range(20)), slots, namespace=3)
    cache.evict(8)
    assert cache.host_size() > 0
    cache.drop_namespace(3)
    assert cache.host_size() == 0 and allocator.available_size() == allocator.size
    put(cache, allocator, pool, list(range(50, 70)))
    cache.evict(20)
    cache.reset()
    allocator.clear()
    assert cache.host_size() == 0 and cache.total_size() == 0


def test_namespaces_load_back_only_their_own_prefixes() -> None:
    cache, allocator, pool = make_cache()
    a = list(range(100, 120))
    slots = allocator.alloc(20)
    for layer in range(pool.num_layers):
        pool.k_buffer[layer][slots] = torch.tensor(a, dtype=torch.float32)[:, None, None].expand(-1, 1, 2)
        pool.v_buffer[layer][slots] = -pool.k_buffer[layer][slots]
    cache.insert(a, slots, namespace=5)
    cache.evict(20)
    assert cache.match_prefix(a).prefix_len == 0  # the base model's namespace
    assert cache.match_prefix(a, namespace=6).prefix_len == 0
    assert kv_tokens(pool, cache.match_prefix(a, namespace=5).device_indices) == a
    check_invariants(cache, allocator)


def test_a_host_tier_larger_than_free_memory_is_refused() -> None:
    layout = KvLayout(num_layers=64, num_kv_heads=8, head_dim=128, v_head_dim=128, dtype=torch.float32, page_size=1)
    with pytest.raises(ConfigError, match=r"--hicache-size/--hicache-ratio: the host tier of this rank needs [\d.]+ GiB"):
        HostMemoryTier(layout, 1 << 40)


def test_bad_write_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--hicache-write-policy: invalid value 'sometimes'"):
        make_cache(policy="sometimes")


@pytest.mark.parametrize("page_size,policy", [(1, "write_back"), (2, "write_through")])
def test_random_work_keeps_both_pools_consistent(page_size: int, policy: str) -> None:
    rng = random.Random(page_size)
    cache, allocator, pool = make_cache(size=48, tier_tokens=40, page_size=page_size, policy=policy)
    stems = [[rng.randrange(1000) for _ in range(12)] for _ in range(4)]
    for _ in range(120):
        key = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.choice((0, 4, 8)))]
        if rng.random() < 0.5:
            match = cache.match_prefix(key)
            assert kv_tokens(pool, match.device_indices) == key[: match.prefix_len]
        else:
            put(cache, allocator, pool, key[: len(key) // page_size * page_size])
        check_invariants(cache, allocator)


def test_slot_runs_split_at_every_gap() -> None:
    from engine.mem_cache.kv_transfer import slot_runs

    assert slot_runs(torch.tensor([5, 6, 7, 2, 3, 9], dtype=torch.int64)) == [(5, 0, 3), (2, 3, 2), (9, 5, 1)]
    assert slot_runs(torch.tensor([4], dtype=torch.int64)) == [(4, 0, 1)]
    assert slot_runs(torch.empty(0, dtype=torch.int64)) == []


_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, False), (torch.float8_e4m3fn, False),
                                          pytest.param(torch.bfloat16, True, marks=pytest.mark.skipif(
                                              not _INTERPRETING, reason="the Triton kernel needs TRITON_INTERPRET=1"))])
def test_row_copies_move_the_same_bytes_as_the_tier_api(dtype: torch.dtype, kernel: bool) -> None:
    """The host tier's rows path (runs of slots, V narrower than K padded in the row) stores what
    ``write`` would, and loads back bit-exactly into other device slots; with the GPU path's
    Triton gather/scatter (checked against torch first, as on a GPU) as with torch ops."""
    from engine.mem_cache.kv_transfer import KvTransfer

    gen = torch.Generator().manual_seed(7)
    pool = MHATokenToKVPool(40, 1, dtype, 2, 8, 3, "cpu", v_head_dim=4)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_((torch.randn(buf.shape, generator=gen) * 3).to(dtype))
    layout = KvLayout.of_pool(pool, 1)
    tier = HostMemoryTier(layout, 32)
    transfer = KvTransfer(pool, tier, "cpu")
    assert transfer.rows is not None and transfer._table is None
    if kernel:
        transfer._table = transfer._kernel_table()
        assert transfer._table is not None
    tier.free(tier.alloc(32)[torch.tensor([3, 4, 10, 11, 12, 20])])  # a fragmented free list
    dev = torch.tensor([7, 1, 30, 31, 32, 2], dtype=torch.int64)
    slots = tier.alloc(6)
    assert slots.tolist() == [4, 5, 11, 12, 13, 21]  # sorted: three runs
    transfer.backup(dev, slots)
    got_k, got_v = tier.read(slots)
    for i in range(3):
        assert torch.equal(got_k[i].view(torch.uint8), pool.k_buffer[i][dev].view(torch.uint8))
        assert torch.equal(got_v[i].view(torch.uint8), pool.v_buffer[i][dev].view(torch.uint8))
    back = torch.tensor([33, 34, 35, 36, 37, 38], dtype=torch.int64)
    transfer.load(slots, back)
    for buf in pool.k_buffer + pool.v_buffer:
        assert torch.equal(buf[back].view(torch.uint8), buf[dev].view(torch.uint8))


@pytest.mark.skipif(not _INTERPRETING, reason="the Triton copy kernel runs on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype,v_dim", [(torch.bfloat16, 4), (torch.float8_e4m3fn, 8)])
def test_the_copy_kernel_gathers_and_scatters_every_layer_in_one_launch(dtype: torch.dtype, v_dim: int) -> None:
    """The GPU path's kernel (here under the interpreter): rows of every part for a set of slots,
    zero past a narrower part's dim, and back into other slots bit-exactly."""
    from engine.mem_cache.kv_copy_kernel import PartTable

    gen = torch.Generator().manual_seed(3)
    parts = [(torch.randn(24, 2, dim, generator=gen) * 3).to(dtype) for dim in (8, 8, v_dim, v_dim)]
    table = PartTable(parts, 2, 8)
    assert table.dense == (v_dim == 8)
    idx = torch.tensor([3, 17, 1, 9, 22, 5, 6, 7, 11, 0], dtype=torch.int64)  # more than one token block
    rows = table.gather(idx)
    assert rows.shape == (10, 4, 2, 8)
    for j, p in enumerate(parts):
        assert torch.equal(rows[:, j, :, : p.shape[2]].view(torch.uint8), p[idx].view(torch.uint8))
        assert not rows[:, j, :, p.shape[2] :].view(torch.uint8).any()
    dest = torch.tensor([12, 13, 14, 15, 16, 18, 19, 20, 21, 23], dtype=torch.int64)
    table.scatter(dest, rows)
    for p in parts:
        assert torch.equal(p[dest].view(torch.uint8), p[idx].view(torch.uint8))
