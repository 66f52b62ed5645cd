"""The hierarchical cache over an MLA pool (V a view of the K rows' leading dims): the scheduler
builds a K-rows-only tier layout, and the mover refuses a tier laid out with V dims of its own.
The bytes moved through the cache are asserted by the KV tier kit's MLA case
(``check_mla_backs_the_cache``, run by the host and file tiers' conformance tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import ServerArgs
from engine.managers.scheduler_hicache import create_hierarchical_cache
from engine.mem_cache import ReqToTokenPool, TokenToKVPoolAllocator
from engine.mem_cache.kv_tier import HostMemoryTier, KvLayout
from engine.mem_cache.kv_transfer import KvTransfer
from engine.mem_cache.memory_pool import MLATokenToKVPool


def _pool() -> MLATokenToKVPool:
    return MLATokenToKVPool(32, 1, torch.bfloat16, kv_lora_rank=16, rope_dim=8, num_layers=3, device="cpu")


def test_the_scheduler_gives_the_tier_the_latent_rows_only() -> None:
    pool = _pool()
    runner = SimpleNamespace(token_to_kv_pool=pool, max_total_num_tokens=32, device=torch.device("cpu"),
                             req_to_token_pool=ReqToTokenPool(2, 64, "cpu"),
                             token_to_kv_pool_allocator=TokenToKVPoolAllocator(32, 1, "cpu"))
    args = ServerArgs(model_path="unused", enable_hierarchical_cache=True, hicache_write_policy="write_back")
    cache = create_hierarchical_cache(args, runner)
    layout = cache.tier.layout
    assert (layout.kv_layout, layout.num_kv_heads, layout.head_dim, layout.v_head_dim) == ("mla", 1, 24, 0)
    # 3 layers x 24 values x 2 bytes; with the V views copied too it was 3 x (24 + 16) x 2 = 240.
    assert layout.bytes_per_token() == 144 == pool.bytes_per_token()
    assert cache.transfer.key_only


def test_a_tier_with_v_dims_is_refused_for_an_mla_pool() -> None:
    pool = _pool()
    layout = KvLayout(num_layers=3, num_kv_heads=1, head_dim=24, v_head_dim=16, dtype=torch.bfloat16, page_size=1)
    with pytest.raises(ValueError, match="v_head_dim 16 for an 'mla' KV pool"):
        KvTransfer(pool, HostMemoryTier(layout, 16), "cpu")
