"""Radix tree over token runs whose values are KV slot indices (prefix reuse).

Each edge stores a run of tokens (``key``) and the KV slots of those tokens
(``value``). With ``page_size > 1`` every key is a whole number of pages and
keys are compared page by page, because the allocator hands out and frees KV in
whole pages: a cached partial page could not be shared without sharing the page.

Prefixes live in namespaces: None (the base model) under the root, and one per LoRA adapter
load (an ``int``) under its own permanently locked child of the root, keyed ``("ns", id)``;
a prefix computed with one adapter is never matched for another or for the base model.

Nodes on the path of a running request are locked (``lock_ref > 0``) and never
evicted; ``evictable_size`` and ``protected_size`` count the tokens of unlocked
and locked nodes and always add up to the tokens stored in the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from engine.errors import ConfigError
from engine.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    MatchResult,
    PrefixCacheReq,
    kv_token_ids,
)

if TYPE_CHECKING:
    from engine.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

EVICTION_POLICIES = ("lru", "lfu")

ChildKey = int | tuple[int, ...]
# Shared placeholder so that creating a node allocates no tensor.
_NO_SLOTS = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the radix tree plus the node it leads to."""

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "lock_ref",
        "last_access_time",
        "hit_count",
        "id",
    )

    def __init__(self, node_id: int) -> None:
        # Keyed by the first token of the child's key (or its first page as a tuple).
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: list[int] = []
        # int64 KV slots, one per token of ``key``.
        self.value: torch.Tensor = _NO_SLOTS
        # Number of running requests whose prefix passes through this node.
        self.lock_ref = 0
        # Logical clock, not wall time, so eviction order is deterministic.
        self.last_access_time = 0
        # Times a match passed through this node (LFU priority).
        self.hit_count = 0
        # Creation order; final tie-break so heap entries never compare nodes.
        self.id = node_id

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    """Length of the common prefix of ``edge`` and ``key[start:]``.

    Whole slices are compared in C first; only a mismatching edge (at most one
    per tree walk) is bisected, so no per-token Python loop runs on long edges.
    """
    n = min(len(edge), len(key) - start)
    if n == len(edge):
        if edge == key[start : start + n]:
            return n
    elif edge[:n] == key[start : start + n]:
        return n
    lo, hi = 0, n  # edge[:lo] matches; the first mismatch lies in [lo, hi)
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if edge[lo:mid] == key[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    while edge[lo] == key[start + lo]:
        lo += 1
    return lo


def _namespace_of(req: PrefixCacheReq) -> int | None:
    """A request's prefix namespace: its LoRA adapter's load id, None for the base model."""
    return getattr(req, "lora_uid", None)


class RadixCache(BasePrefixCache):
    """Prefix cache storing token runs in a radix tree (see module docstring).

    Args:
        req_to_token_pool: request slot -> KV slot table.
        token_to_kv_pool_allocator: where evicted and duplicate KV slots are freed.
        page_size: tokens per KV page; must match the allocator's.
        eviction_policy: ``"lru"`` (least recently used leaf first) or ``"lfu"``
            (fewest hits first, ties by LRU).
    """

    #: node class (the hierarchical cache's nodes carry a host copy too)
    _node_cls: type[TreeNode] = TreeNode

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        eviction_policy: str = "lru",
    ) -> None:
        policy = eviction_policy.lower()
        if policy not in EVICTION_POLICIES:
            accepted = ", ".join(EVICTION_POLICIES)
            raise ConfigError(f"unknown eviction policy {eviction_policy!r}; accepted: {accepted}")
        if page_size < 1 or page_size != token_to_kv_pool_allocator.page_size:
            raise ConfigError(
                f"radix cache page_size {page_size} must be >= 1 and equal the KV allocator's "
                f"page_size {token_to_kv_pool_allocator.page_size}"
            )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.eviction_policy = policy
        self.device = token_to_kv_pool_allocator.device
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.reset()

    # -- lifecycle ----------------------------------------------------------
    def reset(self) -> None:
        """Empties the tree; the pools are left to the caller."""
        self.root_node = self._node_cls(next(self._ids))
        # Returned by every empty match; callers treat match results as read-only.
        self._no_slots = torch.empty(0, dtype=torch.int64, device=self.device)
        self.root_node.value = self._no_slots
        # The root holds no tokens; a permanent lock keeps it out of eviction.
        self.root_node.lock_ref = 1
        self._evictable_size = 0
        self._protected_size = 0

    # -- lookups ------------------------------------------------------------
    def _child_key(self, key: list[int], start: int) -> ChildKey:
        if self.page_size == 1:
            return key[start]
        return tuple(key[start : start + self.page_size])

    def _match_len(self, edge: list[int], key: list[int], start: int) -> int:
        matched = _common_prefix_len(edge, key, start)
        if self.page_size > 1:
            matched -= matched % self.page_size
        return matched

    def _aligned(self, length: int) -> int:
        return length - length % self.page_size

    def _namespace_root(self, namespace: int | None, create: bool) -> TreeNode | None:
        """The node a namespace's prefixes hang from: the root for None, else its child
        ``("ns", namespace)`` (locked for good: it holds no tokens and is never evicted)."""
        if namespace is None:
            return self.root_node
        node = self.root_node.children.get(("ns", namespace))
        if node is None and create:
            node = self._node_cls(next(self._ids))
            node.parent = self.root_node
            node.value = self._no_slots
            node.lock_ref = 1
            self.root_node.children[("ns", namespace)] = node
        return node

    def drop_namespace(self, namespace: int) -> int:
        """Frees every cached prefix of a namespace (an unloaded adapter's); none may be locked
        by a running request. Returns the tokens freed."""
        top = self.root_node.children.pop(("ns", namespace), None)
        if top is None:
            return 0
        freed, stack = [], list(top.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref:
                raise RuntimeError(f"drop_namespace({namespace}): {node!r} is locked by a running request")
            freed.append(node.value)
            stack.extend(node.children.values())
        tokens = sum(len(v) for v in freed)
        self._evictable_size -= tokens
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return tokens

    def match_prefix(self, key: Sequence[int], namespace: int | None = None) -> MatchResult:
        """Longest cached, page-aligned prefix of ``key`` in ``namespace``.

        Splits the last node when the match ends inside its edge, so that locking
        ``last_node`` protects exactly the matched tokens. Refreshes the access
        time and hit count of every node on the path.
        """
        top, path = self._match_path(key, namespace)
        if top is None:
            return MatchResult(device_indices=self._no_slots, last_node=self.root_node)
        return MatchResult(device_indices=self._cat_values(path), last_node=path[-1] if path else top)

    def _match_path(self, key: Sequence[int], namespace: int | None) -> tuple[TreeNode | None, list[TreeNode]]:
        """The namespace's root and the nodes matching ``key``'s longest page-aligned prefix, the
        last one split where the match ends inside its edge; refreshes their access time and hit
        count. (None, []) when the namespace has no tree."""
        if type(key) is not list:  # slices must compare list to list
            key = list(key)
        # A trailing partial page never matches: _match_len rounds down to pages.
        end = self._aligned(len(key))
        top = self._namespace_root(namespace, create=False)
        if top is None:
            return None, []
        now = next(self._clock)
        top.last_access_time = now
        path: list[TreeNode] = []
        node, pos = top, 0
        while pos < end:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            matched = self._match_len(child.key, key, pos)
            if matched == 0:
                break
            if matched < len(child.key):
                child = self._split_node(child, matched)
            child.last_access_time = now
            child.hit_count += 1
            path.append(child)
            node = child
            pos += matched
        return top, path

    def _cat_values(self, nodes: list[TreeNode]) -> torch.Tensor:
        """The device slots of ``nodes``, in order (no copy for a single node)."""
        if not nodes:
            return self._no_slots
        if len(nodes) == 1:
            return nodes[0].value  # type: ignore[return-value]
        return torch.cat([n.value for n in nodes])  # type: ignore[misc]

    def insert(self, key: Sequence[int], value: torch.Tensor, namespace: int | None = None) -> int:
        """Stores ``value`` under ``key`` in ``namespace``; see ``BasePrefixCache.insert``.

        With ``page_size > 1`` only whole pages are stored: a trailing partial
        page of ``key`` is ignored and stays with the caller.
        """
        if len(value) != len(key):
            raise ValueError(f"insert: key has {len(key)} tokens but value has {len(value)} slots")
        if type(key) is not list:  # stored edges must compare list to list
            key = list(key)
        end = self._aligned(len(key))
        node = self._namespace_root(namespace, create=True)
        assert node is not None
        now = next(self._clock)
        node.last_access_time = now
        pos, adopted_from = 0, None
        while pos < end:
            child_key = self._child_key(key, pos)
            child = node.children.get(child_key)
            matched = 0 if child is None else self._match_len(child.key, key, pos)
            if child is None or matched == 0:
                self._add_leaf(node, child_key, key[pos:end], value[pos:end], now)
                break
            if matched < len(child.key):
                child = self._split_node(child, matched)
            child.last_access_time = now
            if self._adopt_on_insert(child, value[pos : pos + matched]):
                adopted_from = pos if adopted_from is None else adopted_from
            elif adopted_from is not None:
                raise AssertionError(f"{child!r} holds slots below a node that adopted the caller's")
            node = child
            pos += matched
        return pos if adopted_from is None else adopted_from

    def _adopt_on_insert(self, node: TreeNode, value: torch.Tensor) -> bool:
        """Whether an existing ``node`` on an insert's path takes the caller's slots ``value``
        for its tokens (then ``insert`` returns the length before the first such node). A plain
        radix tree's nodes always hold their own slots: never."""
        return False

    # -- tree surgery -------------------------------------------------------
    def _add_leaf(
        self, parent: TreeNode, child_key: ChildKey, key: list[int], value: torch.Tensor, now: int
    ) -> TreeNode:
        leaf = self._node_cls(next(self._ids))
        leaf.parent = parent
        leaf.key = key
        # Own a compact int64 copy: callers often pass views of a request's row
        # (or of a larger tensor) that they will reuse.
        leaf.value = value.to(dtype=torch.int64, copy=True)
        leaf.last_access_time = now
        parent.children[child_key] = leaf
        self._evictable_size += len(key)
        return leaf

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cuts ``child``'s edge after ``split_len`` tokens; returns the new upper node.

        The upper node lies on every path through ``child``, so it inherits its
        lock count, access time and hit count; the sizes counters do not change.
        """
        parent = child.parent
        assert parent is not None
        upper = self._node_cls(next(self._ids))
        upper.parent = parent
        upper.key = child.key[:split_len]
        upper.value = child.value[:split_len]
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        upper.hit_count = child.hit_count
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(upper.key, 0)] = upper
        return upper

    # -- eviction and locking -----------------------------------------------
    def _priority(self, node: TreeNode) -> tuple[int, ...]:
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access_time, node.id)
        return (node.last_access_time, node.id)

    def evict(self, num_tokens: int) -> int:
        """Evicts unlocked leaves (LRU or LFU order) until ``num_tokens`` are freed.

        A parent whose last child is evicted becomes a leaf and a candidate in
        turn. Evicted slots go back to the allocator in one ``free`` call.
        """
        if num_tokens <= 0:
            return 0
        heap = [(self._priority(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < num_tokens and heap:
            _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            freed.append(node.value)
            evicted += len(node.key)
            del parent.children[self._child_key(node.key, 0)]
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), parent))
        self._evictable_size -= evicted
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return evicted

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Locks the path from ``node`` to the root; returns the evictable-size change."""
        delta = 0
        while node is not None and node is not self.root_node:
            if node.lock_ref == 0:
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        self._evictable_size += delta
        self._protected_size -= delta
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Unlocks the path from ``node`` to the root; returns the evictable-size change."""
        delta = 0
        while node is not None and node is not self.root_node:
            if node.lock_ref <= 0:
                raise RuntimeError(
                    f"dec_lock_ref on unlocked {node!r}: lock/unlock calls unbalanced"
                )
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.key)
            node = node.parent
        self._evictable_size += delta
        self._protected_size -= delta
        return delta

    # -- request integration ------------------------------------------------
    def cache_finished_req(self, req: PrefixCacheReq, is_insert: bool = True) -> None:
        """Caches (or, with ``is_insert=False``, frees) a finished request's KV.

        The KV exists for ``(origin_input_ids + output_ids)[:-1]`` (the last
        sampled token was never fed through the model), or for ``fill_ids`` when
        nothing was sampled yet; see ``kv_token_ids``.
        """
        assert req.req_pool_idx is not None, f"request {req.rid} holds no request slot"
        token_ids = kv_token_ids(req)
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)].to(torch.int64)
        # Slots before this position are the tree's own (locked prefix); page
        # alignment drops the request's partial tail page written by chunking.
        tree_prefix_len = self._aligned(len(req.prefix_indices))
        allocator = self.token_to_kv_pool_allocator
        if is_insert:
            aligned_len = self._aligned(len(token_ids))
            new_prefix_len = self.insert(token_ids[:aligned_len], kv[:aligned_len], _namespace_of(req))
            # Positions cached meanwhile by another request: ours are duplicates.
            allocator.free(kv[tree_prefix_len:new_prefix_len])
            # The partial last page cannot be cached.
            allocator.free(kv[aligned_len:])
        else:
            allocator.free(kv[tree_prefix_len:])
        self.req_to_token_pool.free(req.req_pool_idx)
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: PrefixCacheReq) -> None:
        """Caches the KV of ``req.fill_ids`` after a prefill chunk.

        Afterwards the request's row in ``req_to_token`` points at the tree's
        slots for the cached part, ``req.last_node`` is locked instead of the old
        one, and ``req.prefix_indices`` covers all of ``fill_ids`` (the tree's
        slots plus, with pages, the request's own partial tail page).
        """
        assert req.req_pool_idx is not None, f"request {req.rid} holds no request slot"
        token_ids = req.fill_ids
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        kv = row[: len(token_ids)].to(torch.int64)
        aligned_len = self._aligned(len(token_ids))
        aligned_ids = token_ids[:aligned_len]
        tree_prefix_len = self._aligned(len(req.prefix_indices))
        namespace = _namespace_of(req)
        new_prefix_len = self.insert(aligned_ids, kv[:aligned_len], namespace)
        self.token_to_kv_pool_allocator.free(kv[tree_prefix_len:new_prefix_len])

        match = self.match_prefix(aligned_ids, namespace)
        new_indices = match.device_indices
        assert len(new_indices) == aligned_len, "just-inserted prefix must match in full"
        # Positions before tree_prefix_len already hold these very slots.
        row[tree_prefix_len:aligned_len] = new_indices[tree_prefix_len:].to(row.dtype)
        # Lock the new path before unlocking the old so shared nodes never
        # become evictable in between.
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        if aligned_len < len(token_ids):
            req.prefix_indices = torch.cat((new_indices, kv[aligned_len:]))
        else:
            req.prefix_indices = new_indices
        req.last_node = match.last_node

    # -- sizes and debugging ------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        """Tokens stored in the tree (O(1); tests check it against a tree walk)."""
        return self._evictable_size + self._protected_size

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_values_flatten(self) -> torch.Tensor:
        """Every KV slot stored in the tree (int64, unordered); for tests."""
        values = [n.value for n in self._nodes()]
        if not values:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(values)

    def pretty_print(self) -> str:
        """One line per node, indented by depth: key head, length, lock count."""
        lines = [
            f"RadixCache(page_size={self.page_size}, policy={self.eviction_policy}, "
            f"evictable={self._evictable_size}, protected={self._protected_size})"
        ]

        # Iterative walk: long shared-prefix chains would overflow recursion.
        stack = [(child, 1) for child in reversed(list(self.root_node.children.values()))]
        while stack:
            node, depth = stack.pop()
            more = "..." if len(node.key) > 8 else ""
            lines.append(
                f"{'  ' * depth}{node.key[:8]}{more} len={len(node.key)} lock={node.lock_ref} "
                f"t={node.last_access_time} hits={node.hit_count}"
            )
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)
