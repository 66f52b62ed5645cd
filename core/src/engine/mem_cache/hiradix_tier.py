"""The storage-tier side of ``HiRadixCache``: tier slot allocation, the tier's LRU eviction,
dropping subtrees, and the cache's counters and log line."""

from __future__ import annotations

import heapq
import logging
import time
from typing import Any

import torch

from engine.mem_cache.kv_tier import KvStorageTier
from engine.mem_cache.kv_transfer import KvTransfer
from engine.mem_cache.radix_cache import TreeNode

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 30.0


class TierSideMixin:
    """Methods of ``HiRadixCache`` that manage its tier (see ``engine.mem_cache.hiradix_cache``)."""

    tier: KvStorageTier
    transfer: KvTransfer
    _pinned_host: set[int]
    lookup_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    dropped_tokens: int
    _logged_at: float
    _logged_counts: tuple[int, ...]

    # RadixCache provides these (it follows this mixin in HiRadixCache's bases).
    _child_key: Any
    _nodes: Any

    def _remove_subtree(self, node: TreeNode) -> None:
        """Takes ``node`` out of the tree and frees the tier slots of it and its descendants
        (which are tier-only); its device slots are the caller's to free."""
        assert node.parent is not None
        del node.parent.children[self._child_key(node.key, 0)]
        self.transfer.complete_writes()
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host_value is not None:
                self.tier.free(n.host_value)
                n.host_value = None
            stack.extend(n.children.values())

    def _tier_alloc(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.tier.alloc(num_tokens)
        if slots is None and num_tokens <= self.tier.size:
            self._evict_tier(num_tokens - self.tier.available_size())
            slots = self.tier.alloc(num_tokens)
        return slots

    def _tier_evictable(self, node: TreeNode) -> bool:
        return (node.host_value is not None and node.id not in self._pinned_host
                and (node.value is not None or not node.children))

    def _evict_tier(self, num_tokens: int) -> int:
        """Frees least-recently-used tier copies: a device node's copy, or a tier-only leaf (which
        leaves the tree, its parent then becoming a candidate)."""
        self.transfer.complete_writes()  # no copy may still be on its way into a freed slot
        heap = [((n.last_access_time, n.id), n) for n in self._nodes() if self._tier_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, node = heapq.heappop(heap)
            assert node.host_value is not None
            self.tier.free(node.host_value)
            node.host_value = None
            freed += len(node.key)
            if node.value is None:
                parent = node.parent
                assert parent is not None
                del parent.children[self._child_key(node.key, 0)]
                if parent.parent is not None and self._tier_evictable(parent):
                    heapq.heappush(heap, ((parent.last_access_time, parent.id), parent))
        return freed


    # -- statistics ------------------------------------------------------------------------
    def host_size(self) -> int:
        """Tokens held in the tier."""
        return self.tier.size - self.tier.available_size()

    def stats(self) -> dict[str, Any]:
        lookups = max(self.lookup_tokens, 1)
        return {
            "hicache_lookup_tokens": self.lookup_tokens,
            "hicache_device_hit_tokens": self.device_hit_tokens,
            "hicache_host_hit_tokens": self.host_hit_tokens,
            "hicache_device_hit_rate": self.device_hit_tokens / lookups,
            "hicache_host_hit_rate": self.host_hit_tokens / lookups,
            "hicache_bytes_written": self.transfer.bytes_written,
            "hicache_bytes_loaded": self.transfer.bytes_loaded,
            "hicache_host_tokens": self.host_size(),
            "hicache_host_capacity_tokens": self.tier.size,
            "hicache_dropped_tokens": self.dropped_tokens,
        }

    def _maybe_log(self) -> None:
        counts = (self.device_hit_tokens, self.host_hit_tokens, self.transfer.tokens_written)
        if time.monotonic() - self._logged_at < _LOG_INTERVAL_S or counts == self._logged_counts:
            return
        self._logged_at, self._logged_counts = time.monotonic(), counts
        s = self.stats()
        logger.info("hicache: device hits %d tok (%.1f%%), host hits %d tok (%.1f%%), written %.1f MiB, "
                    "loaded %.1f MiB, tier %d/%d tok", s["hicache_device_hit_tokens"],
                    100 * s["hicache_device_hit_rate"], s["hicache_host_hit_tokens"], 100 * s["hicache_host_hit_rate"],
                    s["hicache_bytes_written"] / 2**20, s["hicache_bytes_loaded"] / 2**20,
                    s["hicache_host_tokens"], s["hicache_host_capacity_tokens"])
