"""Draft trees as verify rows: node layout, depths, the ancestor mask, and the chain fall-back.

A verify row of a tree runs ``n = 1 + len(tree.tokens)`` tokens: node 0 is the request's last
token (the root), node ``j + 1`` is ``tree.tokens[j]``. ``row_parents`` gives each row node's
parent in that numbering (-1 for the root). Nodes sit in the KV cache at consecutive indices
after the prefix (in node order) but at rotary position ``prefix + depth``; each attends to
the prefix and to its ancestors and itself (``ancestor_mask``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.speculative.base import DraftTree


def is_chain(tree: DraftTree) -> bool:
    """Whether the tree is a chain (``parents == [-1, 0, 1, ...]``)."""
    return all(p == i - 1 for i, p in enumerate(tree.parents))


def row_parents(draft: Sequence[int] | DraftTree) -> list[int]:
    """Parents of a verify row's nodes (node 0 = the last token, parent -1); a list is a chain."""
    if isinstance(draft, DraftTree):
        return [-1] + [p + 1 for p in draft.parents]
    return list(range(-1, len(draft)))


def row_tokens(last: int, draft: Sequence[int] | DraftTree) -> list[int]:
    """A verify row's token ids: the last token, then the draft's nodes."""
    return [last, *(draft.tokens if isinstance(draft, DraftTree) else draft)]


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node of a row (the root: 0); parents come before children."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """``[n, n]`` bool: ``m[i, j]`` is True where node j is node i or one of its ancestors."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m


def tree_mask_of_rows(row_parent_lists: Sequence[Sequence[int]],
                      device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``ForwardBatch.tree_mask`` and ``tree_mask_indptr`` for rows given by their parents."""
    parts = [ancestor_mask(p).flatten() for p in row_parent_lists]
    indptr = [0]
    for p in row_parent_lists:
        indptr.append(indptr[-1] + len(p) * len(p))
    mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
    return (mask.to(device, non_blocking=True),
            torch.tensor(indptr, dtype=torch.int64).to(device, non_blocking=True))


def longest_chain(tree: DraftTree) -> list[int]:
    """The tokens of the tree's first deepest root-to-leaf path (the fall-back where the
    attention backend has no tree mask)."""
    if not tree.tokens:
        return []
    d = depths(tree.parents)
    node = max(range(len(d)), key=lambda i: (d[i], -i))
    path = []
    while node >= 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


def truncate(tree: DraftTree, n: int) -> DraftTree:
    """The tree's first ``n`` nodes (still a tree: parents come before children)."""
    return DraftTree(list(tree.tokens[:n]), list(tree.parents[:n]))
