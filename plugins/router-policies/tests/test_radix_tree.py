from __future__ import annotations

import random

import pytest

from engine_router_policies.radix_tree import ApproxRadixTree


def test_match_prefix_after_inserts() -> None:
    tree = ApproxRadixTree(1000)
    assert tree.match_prefix([1, 2, 3]) == 0
    tree.insert([1, 2, 3, 4, 5])
    assert tree.match_prefix([1, 2, 3, 4, 5]) == 5
    assert tree.match_prefix([1, 2, 3, 9]) == 3  # a match ending inside an edge
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]) == 5
    assert tree.match_prefix([2, 3]) == 0
    tree.insert([1, 2, 7])  # splits the edge after [1, 2]
    assert tree.size == 6
    assert tree.match_prefix([1, 2, 7, 8]) == 3
    assert tree.match_prefix([1, 2, 3, 4]) == 4
    tree.insert([1, 2, 3])  # already held: no growth
    assert tree.size == 6


def test_matches_a_brute_force_model() -> None:
    """Without eviction the tree answers like 'longest common prefix with any inserted prompt'."""
    rng = random.Random(0)
    tree, inserted = ApproxRadixTree(10**9), []
    for _ in range(300):
        base = rng.choice(inserted) if inserted and rng.random() < 0.7 else []
        prompt = base[: rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        query = prompt[: rng.randint(1, len(prompt))] + [rng.randrange(4) for _ in range(rng.randint(0, 3))]
        expected = max((_lcp(query, p) for p in inserted), default=0)
        assert tree.match_prefix(query) == expected
        tree.insert(prompt)
        inserted.append(prompt)
    distinct_prefixes = {tuple(p[:i]) for p in inserted for i in range(1, len(p) + 1)}
    assert tree.size == len(distinct_prefixes)  # one token per distinct non-empty prefix


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_evicts_least_recently_used_leaves_beyond_the_budget() -> None:
    tree = ApproxRadixTree(10)
    tree.insert([1, 1, 1, 1])
    tree.insert([2, 2, 2, 2])
    tree.insert([1, 1, 1, 1])  # touches the first prompt again: the second is now the oldest
    tree.insert([3, 3, 3, 3])  # 12 tokens > 10: the least recently used leaf goes
    assert tree.size <= 10
    assert tree.match_prefix([2, 2, 2, 2]) == 0
    assert tree.match_prefix([1, 1, 1, 1]) == 4
    assert tree.match_prefix([3, 3, 3, 3]) == 4


def test_eviction_removes_emptied_parents_and_keeps_shared_prefixes() -> None:
    tree = ApproxRadixTree(100)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 5, 6])
    assert tree.size == 6
    assert tree.evict(2) == 2  # the older leaf [3, 4]
    assert tree.match_prefix([1, 2, 3]) == 2 and tree.match_prefix([1, 2, 5, 6]) == 4
    assert tree.evict(100) == 4  # everything, parents included once their children are gone
    assert tree.size == 0 and tree.match_prefix([1, 2]) == 0


def test_clear_and_bad_budget() -> None:
    tree = ApproxRadixTree(5)
    tree.insert([1, 2, 3])
    tree.clear()
    assert tree.size == 0 and tree.match_prefix([1, 2, 3]) == 0
    with pytest.raises(ValueError, match="max_tokens"):
        ApproxRadixTree(0)
