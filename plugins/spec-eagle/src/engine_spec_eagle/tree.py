"""EAGLE-2 draft trees: top-k expansion by cumulative log-probability, then dynamic pruning.

Batched over requests on the head's device; the head itself is behind a callback (``Expand``)
so the rule can be tested on fixed log-probabilities.

- **Depth 1**: the ``topk`` most likely tokens after the request's last token.
- **Depth s > 1**: the frontier is the ``topk`` nodes of depth ``s - 1`` with the highest score
  (the sum of the head's log-probabilities along the path); each is expanded by its ``topk``
  most likely children. Nodes of depth ``s - 1`` left out of the frontier stay in the tree as
  leaves.
- **Pruning**: after ``num_steps`` depths, a request keeps its ``keep`` highest-scoring nodes,
  output in creation order (a parent is created before its children, so that order is
  topological).

**Ancestor closure.** A child's score is its parent's plus a log-probability clamped to at most 0,
and float addition is monotone, so a child never scores above its parent. Nodes are ranked by
score with ties going to the node created first (a stable sort over creation order), and a parent
is created before its children: a kept node's parent ranks before it and is kept too. Nodes with
score ``-inf`` (tokens outside the target's vocabulary) are never kept. Which of several
vocabulary entries with equal probability enters a node's top-k is ``torch.topk``'s choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.speculative import DraftTree

#: ``expand(tokens, parents, depth, rows)``: run the head on the frontier of the requests
#: ``rows`` (a host list of request indices): ``tokens`` ``[A, K]`` the frontier's token ids (in
#: the head's vocabulary), ``parents`` ``[A, K]`` each node's index in the previous frontier
#: (depth 1: 0, the root), ``depth`` the frontier's depth. Returns ``[A, K, V]`` log-probabilities
#: of the frontier nodes' children, or None to stop growing (e.g. the head's KV pool is full).
Expand = Callable[[torch.Tensor, torch.Tensor, int, list[int]], "torch.Tensor | None"]


def grow_draft_trees(root_logp: torch.Tensor, expand: Expand, topk: int, num_steps: int, keep: Sequence[int],
                     to_ids: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[DraftTree]:
    """EAGLE-2 trees for a batch of requests.

    Args:
        root_logp: ``[B, V]`` the head's log-probabilities of the token after each request's last
            token (``-inf`` where a token may not be drafted).
        expand: runs the head on a frontier (``Expand``).
        topk: ``K``, the branching (the frontier's size and each expansion's width).
        num_steps: ``S``, the tree's depth.
        keep: per request, the most nodes its tree may have (``num_draft_tokens - 1``, or fewer
            near the request's limits); a request with 0 gets an empty tree and is not expanded.
        to_ids: maps the head's token ids to the trees' (EAGLE-3's draft vocabulary to the
            target's); default: the same ids.

    Returns:
        one ``DraftTree`` per request, its nodes in creation order.
    """
    batch, vocab = root_logp.shape
    k = min(topk, vocab)
    score, tokens = torch.topk(root_logp.float().clamp(max=0.0), k, dim=-1)  # [B, K]
    all_tokens, all_scores, all_parents = [tokens], [score], [torch.full_like(tokens, -1)]
    frontier_tokens, frontier_scores = tokens, score
    frontier_nodes = torch.arange(k, device=tokens.device).expand(batch, k)
    frontier_parents = torch.zeros_like(tokens)  # depth 1: every node's parent is the root
    created = k
    for depth in range(1, num_steps):
        # Requests whose tree may hold a node of depth + 1 (its ancestors count too).
        rows = [b for b in range(batch) if keep[b] > depth]
        if not rows:
            break
        rows_t = torch.tensor(rows, dtype=torch.int64, device=tokens.device)
        logp = expand(frontier_tokens.index_select(0, rows_t), frontier_parents.index_select(0, rows_t), depth, rows)
        if logp is None:
            break
        child_logp, child_tokens = torch.topk(logp.float().clamp(max=0.0), k, dim=-1)  # [A, K, K]
        scores = torch.full((batch, k, k), float("-inf"), device=tokens.device)
        scores[rows_t] = frontier_scores.index_select(0, rows_t).unsqueeze(-1) + child_logp
        children = torch.zeros((batch, k, k), dtype=tokens.dtype, device=tokens.device)
        children[rows_t] = child_tokens.to(tokens.dtype)
        scores, children = scores.flatten(1), children.flatten(1)  # [B, K * K], node order: parent, rank
        parents = frontier_nodes.repeat_interleave(k, dim=1)
        all_tokens.append(children)
        all_scores.append(scores)
        all_parents.append(parents)
        # The next frontier: the K best children (ties: the one created first).
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
        frontier_tokens = children.gather(1, order)
        frontier_scores = scores.gather(1, order)
        frontier_parents = torch.div(order, k, rounding_mode="floor")
        frontier_nodes = created + order
        created += k * k
    node_tokens = torch.cat(all_tokens, 1)
    if to_ids is not None:
        node_tokens = to_ids(node_tokens)
    return prune(node_tokens, torch.cat(all_scores, 1), torch.cat(all_parents, 1), keep)


def prune(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, keep: Sequence[int]) -> list[DraftTree]:
    """Per request, the ``keep[b]`` nodes of highest score (ties: the lower node index) with a
    finite score, in node order, as a ``DraftTree``; ``parents`` index the same node numbering
    (-1: the root). Needs every parent's index below its child's and no child above its parent's
    score (then the kept set is ancestor-closed)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    finite = torch.isfinite(scores)
    tokens_h, parents_h, order_h, finite_h = (t.tolist() for t in (tokens, parents, order, finite))  # one sync
    trees = []
    for b, n in enumerate(keep):
        chosen = sorted(i for i in order_h[b][:max(n, 0)] if finite_h[b][i])
        index = {node: j for j, node in enumerate(chosen)}
        tree_parents = []
        for node in chosen:
            p = parents_h[b][node]
            if p >= 0 and p not in index:
                raise AssertionError(f"draft tree pruning kept node {node} without its parent {p}")
            tree_parents.append(index[p] if p >= 0 else -1)
        trees.append(DraftTree([tokens_h[b][i] for i in chosen], tree_parents))
    return trees
