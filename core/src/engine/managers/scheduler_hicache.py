"""Builds the scheduler's hierarchical prefix cache (``--enable-hierarchical-cache``).

Each scheduler rank gets its own tier instance over its own pool shard: with tensor
parallelism every rank holds its KV heads, schedules the same batches and so evicts and loads
the same nodes, each moving its own shard.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.config import ServerArgs
from engine.errors import ConfigError
from engine.mem_cache.hiradix_cache import HiRadixCache
from engine.mem_cache.kv_tier import KvLayout

logger = logging.getLogger(__name__)


def tier_tokens(args: ServerArgs, device_tokens: int, bytes_per_token: int) -> int:
    """Tier capacity in tokens: ``--hicache-size`` GB, else ``--hicache-ratio`` x the device pool."""
    if args.hicache_size > 0:
        return int(args.hicache_size * 1e9) // max(bytes_per_token, 1)
    return int(device_tokens * args.hicache_ratio)


def create_hierarchical_cache(args: ServerArgs, runner: Any) -> HiRadixCache:
    """The ``HiRadixCache`` over ``runner``'s pools with the tier ``--hicache-storage-backend``."""
    import engine.plugins as plugins

    pool = runner.token_to_kv_pool
    if not (hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer")):
        raise ConfigError(f"--enable-hierarchical-cache: not available for this model's KV pool "
                          f"({type(pool).__name__}); accepted: models with per-layer K and V buffers")
    placement = getattr(runner, "placement", None)
    layout = KvLayout.of_pool(pool, args.page_size, runner.device.type,
                              tp_rank=getattr(placement, "tp_rank", 0), tp_size=getattr(placement, "tp_size", 1))
    tokens = tier_tokens(args, runner.max_total_num_tokens, layout.bytes_per_token())
    if tokens < args.page_size:
        raise ConfigError(f"--hicache-size {args.hicache_size}: holds {tokens} tokens at "
                          f"{layout.bytes_per_token()} bytes per token; accepted: at least one page "
                          f"({args.page_size} tokens)")
    tier = plugins.create_kv_storage_tier(args.hicache_storage_backend, layout, tokens,
                                          disabled=args.disable_plugin, plugin_options=args.plugin_options)
    logger.info("hierarchical cache: %s, %s", tier.describe(), args.hicache_write_policy)
    return HiRadixCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, pool, tier,
                        page_size=args.page_size, eviction_policy=args.radix_eviction_policy,
                        write_policy=args.hicache_write_policy, platform=getattr(runner, "platform", None))
