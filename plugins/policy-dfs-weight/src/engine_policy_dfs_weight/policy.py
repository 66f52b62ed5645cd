"""The ``dfs-weight`` schedule policy's implementation, imported when the policy is selected
(the package's ``__init__`` only registers it)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from engine.managers.policy import PolicyContext, SchedulePolicy

if TYPE_CHECKING:
    from engine.managers.schedule_batch import Req


class DfsWeightPolicy(SchedulePolicy):
    """Depth-first over the cache's node tree, heaviest subtree first.

    At each node the children's subtrees come before the node's own requests (as in
    SGLang): those requests matched the deepest, so they have the most prefix cached.
    Ties between subtrees go to the one holding the earliest arrival, and requests at
    one node run in arrival order, so the order is deterministic. Nodes only need to be
    hashable (identity hashing is enough); ``None`` (no cache information) is its own
    top-level group.
    """

    def order(self, queue: list[Req], ctx: PolicyContext) -> list[Req]:
        groups: dict[Hashable, list[Req]] = {}
        for req in sorted(queue, key=lambda r: r.arrival_seq):
            groups.setdefault(req.last_node, []).append(req)
        children, tops = _spanning_forest(groups, ctx)
        weight, first_seq = _subtree_stats(groups, children, tops)

        def heaviest_first(nodes: Iterable[Hashable]) -> list[Hashable]:
            return sorted(nodes, key=lambda n: (-weight[n], first_seq[n]))

        # Iterative post-order walk: radix trees can be deeper than Python's recursion limit.
        ordered: list[Req] = []
        stack: list[tuple[Hashable, bool]] = [(n, False) for n in reversed(heaviest_first(tops))]
        while stack:
            node, children_done = stack.pop()
            if children_done:
                ordered.extend(groups.get(node, ()))
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(heaviest_first(children.get(node, ()))))
        return ordered


def _spanning_forest(groups: dict[Hashable, list[Req]], ctx: PolicyContext,
                     ) -> tuple[dict[Hashable, list[Hashable]], list[Hashable]]:
    """The part of the cache tree between the requests' nodes and the root.

    Returns each node's children (only those on a path to some request) and the
    top-level nodes (whose parent is None). Each node is asked for its parent once,
    so the cost is linear in the nodes touched, not requests times depth.
    """
    parent_of: dict[Hashable, Hashable | None] = {}
    children: dict[Hashable, list[Hashable]] = {}
    tops: list[Hashable] = []
    for node in groups:
        cur = node
        while cur not in parent_of:
            # ``None`` is the group of requests without a node; do not ask the cache about it.
            parent = None if cur is None else ctx.parent_of(cur)
            parent_of[cur] = parent
            if parent is None:
                tops.append(cur)
                break
            children.setdefault(parent, []).append(cur)
            cur = parent
    return children, tops


def _subtree_stats(groups: dict[Hashable, list[Req]], children: dict[Hashable, list[Hashable]],
                   tops: list[Hashable]) -> tuple[dict[Hashable, int], dict[Hashable, int]]:
    """Per node: waiting requests in its subtree, and the smallest arrival_seq among them."""
    weight: dict[Hashable, int] = {}
    first_seq: dict[Hashable, int] = {}
    preorder: list[Hashable] = []
    stack = list(tops)
    while stack:
        node = stack.pop()
        preorder.append(node)
        stack.extend(children.get(node, ()))
    # Reversed pre-order puts every child before its parent.
    for node in reversed(preorder):
        own = groups.get(node, [])
        weight[node] = len(own) + sum(weight[c] for c in children.get(node, ()))
        # Every node on the forest leads to at least one request, so min() is never empty.
        seqs = [r.arrival_seq for r in own[:1]] + [first_seq[c] for c in children.get(node, ())]
        first_seq[node] = min(seqs)
    return weight, first_seq
