"""An approximate radix tree of one replica's prefix cache, for the cache-aware router.

It holds the prompts the router sent to the replica (token ids), not what the replica's
radix cache really holds: the router never hears from the replicas, so this is a guess
kept in step with the routing decisions, and bounded by ``max_tokens`` with least recently
used leaves evicted first (the replica's own cache evicts the same way, by LRU). No KV
slots, no locks: just enough to answer "how long a prefix of this prompt did I send there".
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "key", "parent", "last_access")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, last_access: int) -> None:
        # First token of a child's key -> child.
        self.children: dict[int, _Node] = {}
        # The token run on the edge into this node (empty at the root).
        self.key = key
        self.parent = parent
        # Logical clock of the last insert through this node (LRU order).
        self.last_access = last_access


class ApproxRadixTree:
    """Token-id runs sent to one replica; ``size`` counts the tokens stored."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens: invalid value {max_tokens}; accepted: >= 1")
        self.max_tokens = max_tokens
        self.size = 0
        self._clock = 0
        self.root = _Node((), None, 0)

    def match_prefix(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` the tree holds (read-only: no LRU update)."""
        node, matched, n = self.root, 0, len(ids)
        while matched < n:
            child = node.children.get(ids[matched])
            if child is None:
                break
            common = _common_prefix(child.key, ids, matched)
            matched += common
            if common < len(child.key):
                break
            node = child
        return matched

    def insert(self, ids: Sequence[int]) -> None:
        """Adds ``ids`` (marking its path most recently used), then evicts down to ``max_tokens``."""
        self._clock += 1
        now = self._clock
        node, pos, n = self.root, 0, len(ids)
        node.last_access = now
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:
                leaf = _Node(tuple(ids[pos:]), node, now)
                node.children[ids[pos]] = leaf
                self.size += n - pos
                break
            common = _common_prefix(child.key, ids, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            node, pos = child, pos + common
        if self.size > self.max_tokens:
            self.evict(self.size - self.max_tokens)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cuts ``child``'s edge after ``at`` tokens; returns the new middle node."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.key[:at], parent, child.last_access)
        parent.children[child.key[0]] = middle
        child.key = child.key[at:]
        child.parent = middle
        middle.children[child.key[0]] = child
        return middle

    def evict(self, num_tokens: int) -> int:
        """Removes least recently used leaves until ``num_tokens`` tokens are gone (or the tree is
        empty); returns how many were removed."""
        leaves = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(leaves)
        removed = 0
        while removed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            removed += len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        self.size -= removed
        return removed

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def clear(self) -> None:
        self.root = _Node((), None, 0)
        self.size = 0


def _common_prefix(key: tuple[int, ...], ids: Sequence[int], start: int) -> int:
    limit = min(len(key), len(ids) - start)
    if tuple(ids[start:start + limit]) == key[:limit]:  # the common case, compared in C
        return limit
    i = 0
    while i < limit and key[i] == ids[start + i]:
        i += 1
    return i
