"""EAGLE-2 tree growth and pruning (``engine_spec_eagle.tree``) on fixed log-probabilities."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.speculative import DraftTree
from engine_spec_eagle.tree import grow_draft_trees

NEG = float("-inf")


def _log(values: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(v) if v > 0 else NEG for v in values], dtype=torch.float32)


class _Head:
    """A fake head: each node's children's log-probabilities are a fixed function of its path.
    Tracks the frontier paths from ``expand``'s ``parents`` as a proposer does."""

    def __init__(self, table: dict[tuple[int, ...], torch.Tensor], root_paths: list[tuple[int, ...]]) -> None:
        self.table = table
        self.paths: list[list[tuple[int, ...]]] = [[p] for p in root_paths]  # per request: previous frontier
        self.calls: list[tuple[list[list[int]], list[list[int]], int, list[int]]] = []

    def expand(self, tokens: torch.Tensor, parents: torch.Tensor, depth: int, rows: list[int]) -> torch.Tensor:
        self.calls.append((tokens.tolist(), parents.tolist(), depth, list(rows)))
        out = []
        for j, b in enumerate(rows):
            frontier = [self.paths[b][p] + (t,) for t, p in zip(tokens[j].tolist(), parents[j].tolist())]
            self.paths[b] = frontier
            out.append(torch.stack([self.table[path] for path in frontier]))
        return torch.stack(out)


def test_expansion_order_and_pruning_by_hand() -> None:
    # Depth 1: tokens 0 (0.5), 1 (0.3). Children: 0 -> 2 (0.7), 3 (0.2); 1 -> 4 (0.9), 0 (0.05).
    # Scores: [0]=0.5, [1]=0.3, [0,2]=0.35, [0,3]=0.1, [1,4]=0.27, [1,0]=0.015.
    table = {(0,): _log([0.02, 0.02, 0.7, 0.2, 0.06]), (1,): _log([0.05, 0.01, 0.02, 0.02, 0.9]),
             (0, 2): _log([0.1, 0.6, 0.05, 0.15, 0.1]), (1, 4): _log([0.3, 0.4, 0.1, 0.1, 0.1])}
    root = _log([0.5, 0.3, 0.1, 0.05, 0.05]).unsqueeze(0)
    head = _Head(table, [()])
    trees = grow_draft_trees(root, head.expand, topk=2, num_steps=2, keep=[3])
    assert head.calls == [([[0, 1]], [[0, 0]], 1, [0])]  # depth 1's frontier, both children of the root
    assert trees == [DraftTree([0, 1, 2], [-1, -1, 0])]  # 0.5, 0.35, 0.3 in creation order
    trees = grow_draft_trees(root, _Head(table, [()]).expand, topk=2, num_steps=2, keep=[4])
    assert trees == [DraftTree([0, 1, 2, 4], [-1, -1, 0, 1])]  # + [1, 4] = 0.27
    # Depth 3: the frontier is the two best of depth 2, [0, 2] (0.35) and [1, 4] (0.27), children of
    # the previous frontier's nodes 0 and 1; [0, 2, 1] = 0.21 beats [0, 3] = 0.1.
    head = _Head(table, [()])
    trees = grow_draft_trees(root, head.expand, topk=2, num_steps=3, keep=[6])
    assert head.calls[1] == ([[2, 4]], [[0, 1]], 2, [0])
    assert trees == [DraftTree([0, 1, 2, 4, 1, 1], [-1, -1, 0, 1, 2, 3])]  # + [0,2,1] 0.21, [1,4,1] 0.108


def test_ties_go_to_the_node_created_first_and_keep_ancestors() -> None:
    # Every child has probability 1 under its parent (log 0): children tie with their parents.
    one = torch.full((4,), NEG)
    one[3] = 0.0
    root = torch.tensor([[0.0, NEG, NEG, NEG]])
    head = _Head({(0,): one, (0, 3): one, (0, 3, 3): one}, [()])
    tree = grow_draft_trees(root, head.expand, topk=1, num_steps=4, keep=[2])[0]
    assert tree == DraftTree([0, 3], [-1, 0])  # the chain's first two nodes, not a deeper tie
    # Equal scores across branches (quarter steps, exact in float32): the node created first wins.
    root = torch.tensor([[-0.25, -0.5, -2.0, -3.0]])
    table = {(0,): torch.tensor([-3.0, -0.25, -1.0, -2.0]), (1,): torch.tensor([0.0, -1.0, -2.0, -3.0])}
    # Nodes: [0] -0.25, [1] -0.5, [0, 1] -0.5, [0, 2] -1.25, [1, 0] -0.5, [1, 1] -1.5.
    tree = grow_draft_trees(root, _Head(table, [()]).expand, topk=2, num_steps=2, keep=[3])[0]
    assert tree == DraftTree([0, 1, 1], [-1, -1, 0])
    tree = grow_draft_trees(root, _Head(table, [()]).expand, topk=2, num_steps=2, keep=[4])[0]
    assert tree == DraftTree([0, 1, 1, 0], [-1, -1, 0, 1])


def test_tokens_that_cannot_be_drafted_are_left_out() -> None:
    root = torch.tensor([[NEG, -1.0, NEG, NEG]])
    # Which -inf tokens fill the top-3 is topk's choice: every one expands to zeros (still -inf).
    table = {(t,): torch.zeros(4) for t in range(4)}
    table[(1,)] = torch.tensor([-0.5, NEG, NEG, NEG])
    tree = grow_draft_trees(root, _Head(table, [()]).expand, topk=3, num_steps=2, keep=[9])[0]
    assert tree == DraftTree([1, 0], [-1, 0])


def test_keep_limits_which_requests_are_expanded_and_stop_ends_growth() -> None:
    root = torch.log_softmax(torch.randn(3, 6, generator=torch.Generator().manual_seed(0)), -1)
    table: dict[tuple[int, ...], torch.Tensor] = {}
    head = _Head(table, [()] * 3)

    def expand(tokens: torch.Tensor, parents: torch.Tensor, depth: int, rows: list[int]) -> torch.Tensor | None:
        if depth == 2:
            return None  # e.g. the head's KV pool is full
        for j, b in enumerate(rows):
            for t, p in zip(tokens[j].tolist(), parents[j].tolist()):
                table[head.paths[b][p] + (t,)] = torch.log_softmax(torch.randn(6), -1)
        return head.expand(tokens, parents, depth, rows)

    trees = grow_draft_trees(root, expand, topk=2, num_steps=4, keep=[0, 1, 5])
    assert [c[2:] for c in head.calls] == [(1, [2])]  # only the request whose tree may reach depth 2
    assert [len(t.tokens) for t in trees] == [0, 1, 5]  # growth stopped at depth 2 (6 nodes), pruned to 5
    assert trees[1].parents == [-1]


def _reference(root: list[float], table: dict[tuple[int, ...], list[float]], k: int, steps: int,
               keep: int) -> DraftTree:
    """The rule in plain Python: nodes (score, path, parent) in creation order."""
    def best(values: list[float]) -> list[int]:
        return sorted(range(len(values)), key=lambda t: -values[t])[:k]  # values within a node are distinct

    nodes: list[tuple[float, tuple[int, ...], int]] = [(root[t], (t,), -1) for t in best(root)]
    layer = list(range(len(nodes)))
    for _ in range(1, steps):
        frontier = sorted(layer, key=lambda i: (-nodes[i][0], i))[:k]
        layer = []
        for i in frontier:
            values = table[nodes[i][1]]
            for t in best(values):
                layer.append(len(nodes))
                nodes.append((nodes[i][0] + values[t], nodes[i][1] + (t,), i))
    kept = sorted(i for i in sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], i))[:keep]
                  if nodes[i][0] > NEG)
    index = {i: j for j, i in enumerate(kept)}
    return DraftTree([nodes[i][1][-1] for i in kept], [index[nodes[i][2]] if nodes[i][2] >= 0 else -1 for i in kept])


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_rule_in_plain_python_with_many_ties(seed: int) -> None:
    # Log-probabilities are distinct multiples of -1/4 per node (exact in float32), so scores of
    # different nodes tie often and the tie rule decides.
    rng = random.Random(seed)
    vocab, k, steps, batch = 7, rng.choice([2, 3, 4]), rng.choice([1, 2, 3, 4]), 3
    keep = [rng.randrange(0, 12) for _ in range(batch)]
    table: dict[tuple[int, ...], torch.Tensor] = {}

    def row() -> torch.Tensor:
        values = [-0.25 * v for v in rng.sample(range(12), vocab)]
        return torch.tensor(values, dtype=torch.float32)

    roots = [row() for _ in range(batch)]
    paths: list[list[tuple[int, ...]]] = [[()] for _ in range(batch)]

    def expand(tokens: torch.Tensor, parents: torch.Tensor, depth: int, rows: list[int]) -> torch.Tensor:
        out = []
        for j, b in enumerate(rows):
            paths[b] = [paths[b][p] + (t,) for t, p in zip(tokens[j].tolist(), parents[j].tolist())]
            out.append(torch.stack([table.setdefault(p, row()) for p in paths[b]]))
        return torch.stack(out)

    trees = grow_draft_trees(torch.stack(roots), expand, k, steps, keep)
    lists = {p: v.tolist() for p, v in table.items()}
    for b in range(batch):
        # The reference expands only paths the builder asked about (rows whose keep allows depth).
        expected = _reference(roots[b].tolist(), lists, k, min(steps, max(keep[b], 1)),
                              keep[b])
        assert trees[b] == expected
        assert len(trees[b].tokens) == min(keep[b], k + (min(steps, max(keep[b], 1)) - 1) * k * k)
        for j, p in enumerate(trees[b].parents):
            assert -1 <= p < j  # topological, ancestor-closed


def test_chain_with_topk_one_is_greedy() -> None:
    torch.manual_seed(1)
    table = {}
    path: tuple[int, ...] = ()
    root = torch.log_softmax(torch.randn(1, 9), -1)
    expected = [int(root.argmax())]
    for _ in range(3):
        path = path + (expected[-1],)
        table[path] = torch.log_softmax(torch.randn(9), -1)
        expected.append(int(table[path].argmax()))
    tree = grow_draft_trees(root, _Head(table, [()]).expand, topk=1, num_steps=4, keep=[4])[0]
    assert tree == DraftTree(expected, [-1, 0, 1, 2])
