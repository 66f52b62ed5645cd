"""Hierarchical prefix cache: a radix tree whose nodes live on the device, in a tier, or both.

A node evicted from the device pool is copied to a storage tier (host memory by default,
``engine.mem_cache.kv_tier``) instead of being dropped, and stays in the tree. A later match
that reaches such nodes loads them back into freshly allocated device slots before the
request's prefill. Node states:

* device: ``value`` holds device slots, ``host_value`` is None;
* tier: ``value`` is None, ``host_value`` holds tier slots;
* both: a tier copy exists beside the device slots (write-through, or a node loaded back).

Device nodes form a top-closed subtree (a device node's parent is on the device): eviction
takes device leaves, and a load brings back the whole matched path below the last device node.
The tier evicts least-recently-used: tier copies of device nodes, and tier-only leaves (which
then leave the tree). Write policies: ``write_through`` copies every inserted node at once (an
eviction then only frees device slots); ``write_back`` copies a node when it is evicted.

The size counters of ``RadixCache`` (``evictable_size``, ``protected_size``) count device
tokens only: they are what the scheduler can reclaim.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.errors import ConfigError
from engine.mem_cache.base_prefix_cache import MatchResult
from engine.mem_cache.hiradix_tier import TierSideMixin
from engine.mem_cache.kv_tier import KvStorageTier
from engine.mem_cache.kv_transfer import KvTransfer
from engine.mem_cache.radix_cache import RadixCache, TreeNode

WRITE_POLICIES = ("write_through", "write_back")


class HiTreeNode(TreeNode):
    """A radix node with an optional tier copy; ``value`` is None while only the tier has it."""

    __slots__ = ("host_value",)

    def __init__(self, node_id: int) -> None:
        super().__init__(node_id)
        self.host_value: torch.Tensor | None = None


class HiRadixCache(TierSideMixin, RadixCache):
    """``RadixCache`` backed by a storage tier (see the module docstring).

    Args:
        kv_pool: the device KV pool (``k_buffer``/``v_buffer`` per layer) the slots index.
        tier: where evicted nodes go; its slots are allocated and freed here.
        write_policy: ``write_through`` or ``write_back``.
        platform: the ``engine.platforms.Platform`` whose streams and events overlap the copies
            with compute; None copies synchronously.
        The other arguments are ``RadixCache``'s.
    """

    _node_cls = HiTreeNode

    def __init__(self, req_to_token_pool: Any, token_to_kv_pool_allocator: Any, kv_pool: Any,
                 tier: KvStorageTier, page_size: int = 1, eviction_policy: str = "lru",
                 write_policy: str = "write_through", platform: Any | None = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ConfigError(f"--hicache-write-policy: invalid value {write_policy!r}; "
                              f"accepted: {', '.join(WRITE_POLICIES)}")
        if tier.layout.page_size != page_size:
            raise ConfigError(f"KV tier page size {tier.layout.page_size} must equal --page-size {page_size}")
        self.tier = tier
        self.write_policy = write_policy
        self.transfer = KvTransfer(kv_pool, tier, token_to_kv_pool_allocator.device, platform)
        # Tier-only nodes a running load reads: the tier must not evict them meanwhile.
        self._pinned_host: set[int] = set()
        self._count_hits = True
        # The latest counted match, (lookup, device hit, host hit tokens, node ids loaded for it),
        # added to the counters when its request is admitted (note_admitted).
        self._pending_hits: tuple[int, int, int, set[int]] | None = None
        # Nodes loaded back for a request not admitted yet: its next match finds them on the
        # device, and they still count as host hits then.
        self._loaded_unclaimed: set[int] = set()
        self.lookup_tokens = 0  # prompt tokens matched against the cache at admission
        self.device_hit_tokens = 0
        self.host_hit_tokens = 0
        self.dropped_tokens = 0  # evicted from the device with no room in the tier
        self._logged_at = time.monotonic()
        self._logged_counts: tuple[int, ...] = ()
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, eviction_policy)

    def reset(self) -> None:
        super().reset()
        self.transfer.reset()
        self.tier.clear()

    # -- matching and loading back ------------------------------------------------
    def match_prefix(self, key: Sequence[int], namespace: int | None = None,
                     load_back: bool = True) -> MatchResult:
        """Longest cached prefix in ``namespace``; tier-resident nodes on the path are loaded
        into device slots first (``load_back``, when the device has room), so the result is
        always device slots."""
        self.transfer.poll()
        top, path = self._match_path(key, namespace)
        if top is None:
            return MatchResult(device_indices=self._no_slots, last_node=self.root_node)
        on_device = 0
        while on_device < len(path) and path[on_device].value is not None:
            on_device += 1
        device_nodes, tier_nodes = path[:on_device], path[on_device:]
        loaded: list[TreeNode] = []
        if tier_nodes and load_back:
            loaded = self._load_back(device_nodes[-1] if device_nodes else top, tier_nodes)
        if load_back and self._count_hits:
            from_host = [n for n in device_nodes if n.id in self._loaded_unclaimed] + loaded
            self._loaded_unclaimed.update(n.id for n in loaded)
            host = sum(len(n.key) for n in from_host)
            device = sum(len(n.key) for n in device_nodes) + sum(len(n.key) for n in loaded) - host
            self._pending_hits = (len(key), device, host, {n.id for n in from_host})
        nodes = device_nodes + loaded
        return MatchResult(device_indices=self._cat_values(nodes), last_node=nodes[-1] if nodes else top)

    def note_admitted(self) -> None:
        if self._pending_hits is None:
            return
        lookup, device, host, claimed = self._pending_hits
        self._pending_hits = None
        self.lookup_tokens += lookup
        self.device_hit_tokens += device
        self.host_hit_tokens += host
        self._loaded_unclaimed -= claimed
        if len(self._loaded_unclaimed) > 65536:  # ids of nodes whose requests never came back
            self._loaded_unclaimed.clear()
        self._maybe_log()

    def prefix_hint(self, key: Sequence[int], namespace: int | None = None) -> MatchResult:
        """The device part of the match, loading nothing (admission ordering only)."""
        return self.match_prefix(key, namespace, load_back=False)

    def _load_back(self, anchor: TreeNode, nodes: list[TreeNode]) -> list[TreeNode]:
        """Gives ``nodes`` (tier-only, a path below the device node ``anchor``) device slots and
        copies their KV in; returns them, or [] when the device cannot make room."""
        total = sum(len(n.key) for n in nodes)
        allocator = self.token_to_kv_pool_allocator
        self._pinned_host = {n.id for n in nodes}
        self.inc_lock_ref(anchor)  # the matched device prefix must survive the eviction below
        try:
            if allocator.available_size() < total:
                self.evict(total - allocator.available_size())
            slots = allocator.alloc(total)
        finally:
            self.dec_lock_ref(anchor)
            self._pinned_host = set()
        if slots is None:
            return []
        tier_slots = torch.cat([n.host_value for n in nodes])  # type: ignore[misc]
        self.transfer.load(tier_slots, slots)
        pos = 0
        for n in nodes:
            n.value = slots[pos : pos + len(n.key)].to(torch.int64, copy=True)
            pos += len(n.key)
        self._evictable_size += total
        return nodes

    def ready_for_forward(self) -> None:
        self.transfer.wait_loads()

    # -- inserting -------------------------------------------------------------------
    def _adopt_on_insert(self, node: TreeNode, value: torch.Tensor) -> bool:
        """A tier-only node on the path takes the caller's slots for its tokens (the caller just
        computed them), so ``insert`` returns a length that ends before it."""
        if node.value is not None:
            return False
        node.value = value.to(dtype=torch.int64, copy=True)
        self._evictable_size += len(value)
        return True

    def _add_leaf(self, parent: TreeNode, child_key: Any, key: list[int], value: torch.Tensor,
                  now: int) -> TreeNode:
        leaf = super()._add_leaf(parent, child_key, key, value, now)
        if self.write_policy == "write_through":
            self._back_up(leaf)
        return leaf

    def _back_up(self, node: TreeNode) -> bool:
        """Copies a device node to the tier; False when the tier has no room for it."""
        slots = self._tier_alloc(len(node.key))
        if slots is None:
            return False
        self.transfer.backup(node.value, slots)
        node.host_value = slots
        return True

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        value, host = child.value, child.host_value
        child.value = value if value is not None else self._no_slots
        upper = super()._split_node(child, split_len)
        if value is None:
            upper.value = child.value = None
        upper.host_value = None if host is None else host[:split_len]
        child.host_value = None if host is None else host[split_len:]
        return upper

    # -- eviction ----------------------------------------------------------------------
    def _is_device_leaf(self, node: TreeNode) -> bool:
        return (node.value is not None and node.lock_ref == 0
                and all(c.value is None for c in node.children.values()))

    def evict(self, num_tokens: int) -> int:
        """Evicts unlocked device leaves (LRU or LFU) until ``num_tokens`` device slots are freed;
        each goes to the tier (copied now unless it has a copy), or is dropped with its tier-only
        subtree when the tier has no room."""
        if num_tokens <= 0:
            return 0
        heap = [(self._priority(n), n) for n in self._nodes() if self._is_device_leaf(n)]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < num_tokens and heap:
            _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node.value is not None
            freed.append(node.value)
            evicted += len(node.key)
            if node.host_value is not None or self._back_up(node):
                node.value = None
            else:
                self.dropped_tokens += len(node.key)
                self._remove_subtree(node)
            if parent.parent is not None and parent.lock_ref == 0 and self._is_device_leaf(parent):
                heapq.heappush(heap, (self._priority(parent), parent))
        self._evictable_size -= evicted
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return evicted

    # -- request integration and namespaces -----------------------------------------------------
    def cache_unfinished_req(self, req: Any) -> None:
        # Its internal re-match is bookkeeping, not a lookup: it must not count as a hit.
        self._count_hits = False
        try:
            super().cache_unfinished_req(req)
        finally:
            self._count_hits = True

    def drop_namespace(self, namespace: int) -> int:
        top = self.root_node.children.pop(("ns", namespace), None)
        if top is None:
            return 0
        self.transfer.complete_writes()
        freed, stack = [], list(top.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref:
                raise RuntimeError(f"drop_namespace({namespace}): {node!r} is locked by a running request")
            if node.value is not None:
                freed.append(node.value)
            if node.host_value is not None:
                self.tier.free(node.host_value)
            stack.extend(node.children.values())
        tokens = sum(len(v) for v in freed)
        self._evictable_size -= tokens
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return tokens

    def all_values_flatten(self) -> torch.Tensor:
        values = [n.value for n in self._nodes() if n.value is not None]
        if not values:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(values)
