"""``check_kv_tier`` / ``KvStorageTierConformance``: a KV storage tier stores and returns K and V
bit-exactly per slot (float32, bfloat16, float8; page sizes 1 and 4; V narrower than K), keeps
two tensor-parallel ranks' instances apart, and backs the hierarchical prefix cache: a prefix
evicted from a device pool into the tier comes back with the same KV, for an MLA pool too (whose
tier layout has ``v_head_dim`` 0: only the latent K rows are stored, V tensors are empty)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from engine.mem_cache.kv_tier import KvLayout, KvStorageTier
from engine.testing.conformance._common import KIT_SEED, derive_seed, generator

#: (dtype, page size) cases the kit runs.
CASES = ((torch.float32, 1), (torch.bfloat16, 4), (torch.float8_e4m3fn, 2))
TIER_TOKENS = 64

TierFactory = Callable[[KvLayout, int], KvStorageTier]


def kit_layout(dtype: torch.dtype = torch.float32, page_size: int = 1, tp_rank: int = 0) -> KvLayout:
    """A small layout: 2 layers, 2 KV heads, K dim 8, V dim 4."""
    return KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, v_head_dim=4, dtype=dtype,
                    page_size=page_size, device_type="cpu", tp_rank=tp_rank, tp_size=2)


def tier_factory(name: str, plugin_options: dict[str, dict[str, Any]] | None = None) -> TierFactory:
    """Builds the registered tier ``name``; ``plugin_options`` as in YAML, ``{plugin: {key: value}}``,
    over the plugin's declared defaults."""
    from engine import plugins

    def build(layout: KvLayout, num_tokens: int) -> KvStorageTier:
        return plugins.create_kv_storage_tier(name, layout, num_tokens, plugin_options=plugin_options or {})

    return build


def _random_kv(gen: torch.Generator, layout: KvLayout, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    def one(dim: int) -> torch.Tensor:
        return (torch.randn(n, layout.num_kv_heads, dim, generator=gen) * 4).to(layout.dtype)

    return ([one(layout.head_dim) for _ in range(layout.num_layers)],
            [one(layout.v_head_dim) for _ in range(layout.num_layers)])


def _same(got: list[torch.Tensor], want: list[torch.Tensor], layout: KvLayout, n: int, what: str) -> None:
    assert len(got) == layout.num_layers, f"{what}: {len(got)} layers returned, expected {layout.num_layers}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.device.type == "cpu", f"{what}: layer {i} returned on {g.device}, not the CPU"
        assert g.dtype == layout.dtype, f"{what}: layer {i} returned {g.dtype}, not {layout.dtype}"
        assert tuple(g.shape) == (n, *w.shape[1:]), f"{what}: layer {i} has shape {tuple(g.shape)}"
        # Bit-exact: a tier stores bytes, it computes nothing.
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"{what}: layer {i} differs from what was written"


def check_round_trip(factory: TierFactory, dtype: torch.dtype, page_size: int, seed: int = KIT_SEED) -> None:
    """Writes random KV at scattered slots, overwrites some, reads back in another order."""
    layout = kit_layout(dtype, page_size)
    tier = factory(layout, TIER_TOKENS)
    case = f"{type(tier).__name__} ({dtype}, page size {page_size})"
    try:
        assert tier.size % page_size == 0 and tier.size >= TIER_TOKENS - page_size, f"{case}: size {tier.size}"
        slots = tier.alloc(tier.size)
        assert slots is not None and len(slots) == tier.size, f"{case}: cannot allocate its whole size"
        assert tier.alloc(page_size) is None, f"{case}: allocated more than its size"
        gen = generator(derive_seed(seed, str(dtype), page_size))
        perm = slots[torch.randperm(len(slots), generator=gen)]
        k, v = _random_kv(gen, layout, len(perm))
        tier.write(perm, k, v)
        again = perm[:5]
        k2, v2 = _random_kv(gen, layout, len(again))
        tier.write(again, k2, v2)
        for i in range(layout.num_layers):
            k[i][:5], v[i][:5] = k2[i], v2[i]
        order = torch.randperm(len(perm), generator=gen)
        got_k, got_v = tier.read(perm[order])
        _same(got_k, [t[order] for t in k], layout, len(perm), f"{case}: K")
        _same(got_v, [t[order] for t in v], layout, len(perm), f"{case}: V")
        if tier.returns_pinned:
            assert all(t.is_pinned() for t in got_k + got_v), f"{case}: returns_pinned but read is not pinned"
        empty_k, _ = tier.read(torch.empty(0, dtype=torch.int64))
        assert all(t.shape[0] == 0 for t in empty_k), f"{case}: reading no slots returned rows"
        tier.free(slots)
        assert tier.available_size() == tier.size, f"{case}: slots not free after free()"
    finally:
        tier.close()


def check_ranks_apart(factory: TierFactory, seed: int = KIT_SEED) -> None:
    """Two ranks' tiers in one process (as on one host) keep their data apart."""
    gen = generator(derive_seed(seed, "ranks"))
    tiers = [factory(kit_layout(tp_rank=r), TIER_TOKENS) for r in (0, 1)]
    try:
        slots = torch.arange(1, 17)
        written = []
        for tier in tiers:
            kv = _random_kv(gen, tier.layout, len(slots))
            tier.write(slots, *kv)
            written.append(kv)
        for rank, (tier, (k, v)) in enumerate(zip(tiers, written, strict=True)):
            got_k, got_v = tier.read(slots)
            _same(got_k, k, tier.layout, len(slots), f"rank {rank}: K")
            _same(got_v, v, tier.layout, len(slots), f"rank {rank}: V")
    finally:
        for tier in tiers:
            tier.close()


def _insert_evicting(cache: Any, allocator: Any, pool: Any, layout: KvLayout, gen: torch.Generator,
                     keys: list[list[int]]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Inserts each key into ``cache`` with fresh random KV written into ``pool`` (V only when the
    layout has one), evicting into the tier first when the pool is too full; the KV of each key."""
    kv = []
    for key in keys:
        if allocator.available_size() < len(key):
            cache.evict(len(key) - allocator.available_size())
        slots = allocator.alloc(len(key))
        assert slots is not None
        k, v = _random_kv(gen, layout, len(key))
        for i in range(layout.num_layers):
            pool.k_buffer[i][slots] = k[i]
            if layout.v_head_dim:
                pool.v_buffer[i][slots] = v[i]
        cache.insert(key, slots)
        kv.append((k, v))
    return kv


def check_backs_the_cache(factory: TierFactory, seed: int = KIT_SEED) -> None:
    """A prefix evicted from a small device pool into the tier loads back with the same KV."""
    from engine.mem_cache import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
    from engine.mem_cache.hiradix_cache import HiRadixCache

    layout = kit_layout(torch.float32, 1)
    pool = MHATokenToKVPool(24, 1, layout.dtype, layout.num_kv_heads, layout.head_dim, layout.num_layers, "cpu",
                            v_head_dim=layout.v_head_dim)
    allocator = TokenToKVPoolAllocator(24, 1, "cpu")
    tier = factory(layout, TIER_TOKENS)
    cache = HiRadixCache(ReqToTokenPool(2, 32, "cpu"), allocator, pool, tier, write_policy="write_back")
    gen = generator(derive_seed(seed, "cache"))
    try:
        keys = [list(range(100, 116)), list(range(200, 216))]
        kv = _insert_evicting(cache, allocator, pool, layout, gen, keys)
        assert cache.host_size() >= len(keys[0]), "the first prefix did not go to the tier"
        match = cache.match_prefix(keys[0])
        assert match.prefix_len == len(keys[0]), f"the evicted prefix matched {match.prefix_len} tokens"
        idx = match.device_indices
        _same([b[idx] for b in pool.k_buffer], kv[0][0], layout, len(idx), "loaded back: K")
        _same([b[idx] for b in pool.v_buffer], kv[0][1], layout, len(idx), "loaded back: V")
    finally:
        tier.close()


def check_mla_backs_the_cache(factory: TierFactory, seed: int = KIT_SEED) -> None:
    """An MLA pool (V is a view of its K rows) through the cache: the tier gets K rows and empty V,
    the evicted prefix loads back bit-exactly, and the bytes moved are the K rows' only."""
    from engine.mem_cache import ReqToTokenPool, TokenToKVPoolAllocator
    from engine.mem_cache.hiradix_cache import HiRadixCache
    from engine.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(24, 1, torch.float32, kv_lora_rank=8, rope_dim=4, num_layers=2, device="cpu")
    layout = KvLayout.of_pool(pool, 1)
    assert (layout.kv_layout, layout.head_dim, layout.v_head_dim) == ("mla", 12, 0), layout
    allocator = TokenToKVPoolAllocator(24, 1, "cpu")
    tier = factory(layout, TIER_TOKENS)
    cache = HiRadixCache(ReqToTokenPool(2, 32, "cpu"), allocator, pool, tier, write_policy="write_back")
    gen = generator(derive_seed(seed, "mla cache"))
    try:
        keys = [list(range(100, 116)), list(range(200, 216))]
        rows = [k for k, _ in _insert_evicting(cache, allocator, pool, layout, gen, keys)]
        match = cache.match_prefix(keys[0])
        assert match.prefix_len == len(keys[0]), f"MLA: the evicted prefix matched {match.prefix_len} tokens"
        idx = match.device_indices
        _same([b[idx] for b in pool.k_buffer], rows[0], layout, len(idx), "MLA loaded back: K rows")
        stats = cache.stats()
        # 2 layers x 12 dims x 4 bytes = 96 bytes a token; copying the V views too would move
        # 2 x (12 + 8) x 4 = 160.
        per_token = layout.num_layers * (pool.kv_lora_rank + pool.rope_dim) * 4
        moved = stats["hicache_bytes_written"] + stats["hicache_bytes_loaded"]
        tokens = cache.transfer.tokens_written + cache.transfer.tokens_loaded
        assert tokens >= 2 * len(keys[0]) and moved == tokens * per_token, (
            f"MLA: {moved} bytes moved for {tokens} token copies; expected {per_token} a token (K rows only)")
    finally:
        tier.close()


class KvStorageTierConformance:
    """Set ``tier_name`` (and ``plugin_options``, ``{plugin: {key: value}}``: e.g. a directory)."""

    tier_name: ClassVar[str] = ""
    plugin_options: ClassVar[dict[str, dict[str, Any]]] = {}
    seed: ClassVar[int] = KIT_SEED

    def factory(self) -> TierFactory:
        return tier_factory(self.tier_name, self.plugin_options)

    def test_spec(self) -> None:
        from engine import plugins

        spec = plugins.get_kv_storage_tier(self.tier_name)
        assert spec.name == self.tier_name
        assert "cpu" in spec.device_types, f"'{self.tier_name}' does not list cpu in device_types"

    def test_round_trip(self) -> None:
        for dtype, page_size in CASES:
            check_round_trip(self.factory(), dtype, page_size, self.seed)

    def test_ranks_kept_apart(self) -> None:
        check_ranks_apart(self.factory(), self.seed)

    def test_backs_the_prefix_cache(self) -> None:
        check_backs_the_cache(self.factory(), self.seed)

    def test_backs_the_prefix_cache_of_an_mla_pool(self) -> None:
        check_mla_backs_the_cache(self.factory(), self.seed)


def check_kv_tier(factory: TierFactory, seed: int = KIT_SEED) -> None:
    """Every check of the kit on a tier factory ``(layout, num_tokens) -> KvStorageTier``."""
    for dtype, page_size in CASES:
        check_round_trip(factory, dtype, page_size, seed)
    check_ranks_apart(factory, seed)
    check_backs_the_cache(factory, seed)
    check_mla_backs_the_cache(factory, seed)
