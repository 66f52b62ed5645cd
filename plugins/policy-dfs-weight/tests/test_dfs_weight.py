from __future__ import annotations


from engine import plugins
from engine.managers.policy import PolicyContext
from engine.managers.schedule_batch import Req
from engine.sampling.sampling_params import SamplingParams
from engine.testing import SchedulePolicyConformance
from engine_policy_dfs_weight import DfsWeightPolicy


class TestDfsWeight(SchedulePolicyConformance):
    policy_name = "dfs-weight"


class _Node:
    """A stand-in for a radix node: only ``parent`` and identity hashing matter."""

    def __init__(self, name: str, parent: _Node | None = None) -> None:
        self.name = name
        self.parent = parent

    def __repr__(self) -> str:
        return self.name


_CTX = PolicyContext(parent_of=lambda n: n.parent)


def _req(rid: str, node: object) -> Req:
    req = Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=8), set())
    req.last_node = node
    return req


def test_spec_is_cache_aware() -> None:
    assert plugins.get_schedule_policy("dfs-weight").cache_aware


def test_heavier_subtree_first_children_before_own_requests() -> None:
    root = _Node("root")
    a, b = _Node("a", root), _Node("b", root)
    a1, a2 = _Node("a1", a), _Node("a2", a)
    # Arrival order: r0..r5. Weights: a1=2, a2=1, a=4 (with its own r5), b=1.
    reqs = [_req("r0", b), _req("r1", a1), _req("r2", a2), _req("r3", a1), _req("r4", root),
            _req("r5", a)]
    ordered = DfsWeightPolicy().order(list(reversed(reqs)), _CTX)
    assert [r.rid for r in ordered] == ["r1", "r3", "r2", "r5", "r0", "r4"]


def test_equal_weights_break_ties_by_earliest_arrival_in_subtree() -> None:
    root = _Node("root")
    x, y = _Node("x", root), _Node("y", root)
    y1 = _Node("y1", y)  # y's only request sits one level down; it still arrived first
    reqs = [_req("first", y1), _req("second", x), _req("third", x), _req("fourth", y)]
    ordered = DfsWeightPolicy().order(reqs, _CTX)
    assert [r.rid for r in ordered] == ["first", "fourth", "second", "third"]


def test_requests_without_node_are_one_group_and_separate_trees_are_ordered() -> None:
    t1, t2 = _Node("t1"), _Node("t2")  # two roots: parent_of gives None for both
    reqs = [_req("n0", None), _req("t2a", t2), _req("t1a", t1), _req("t2b", t2), _req("n1", None),
            _req("n2", None)]
    ordered = DfsWeightPolicy().order(reqs, _CTX)
    assert [r.rid for r in ordered] == ["n0", "n1", "n2", "t2a", "t2b", "t1a"]


def test_deep_tree_does_not_recurse() -> None:
    node = _Node("root")
    chain = [node]
    for i in range(5000):
        node = _Node(f"n{i}", node)
        chain.append(node)
    reqs = [_req("shallow", chain[10]), _req("deep", chain[-1])]
    ordered = DfsWeightPolicy().order(reqs, _CTX)
    assert [r.rid for r in ordered] == ["deep", "shallow"]


def test_parent_is_asked_once_per_node() -> None:
    root = _Node("root")
    mid = _Node("mid", root)
    leaves = [_Node(f"l{i}", mid) for i in range(10)]
    asked: list[object] = []

    def parent_of(n: _Node) -> _Node | None:
        asked.append(n)
        return n.parent

    reqs = [_req(f"r{i}", leaf) for i, leaf in enumerate(leaves)]
    DfsWeightPolicy().order(reqs, PolicyContext(parent_of=parent_of))
    assert len(asked) == len(set(map(id, asked))) == 12
