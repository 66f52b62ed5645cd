"""The EAGLE proposer: its tree rows, and a full head pool.

The tree path (``EagleProposer._grow_trees``) against its chain path, with the core verifying
chains: each step the proposer first grows trees (top-k 4), then its state is put
back and it drafts the chains the core verifies. The head's log-probabilities at every tree node
on the greedy path must give the chain's next draft (same head, same features, same attention
span), which checks the tree rows' ancestor KV, positions and parent features."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.speculative import DraftTree
from engine.testing.harness import generate_greedy, make_scheduler
from engine_spec_eagle import tree as tree_module
from engine_spec_eagle.testing import make_eagle_head


@pytest.fixture(scope="module")
def target(tmp_path_factory: Any) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("target")), "LlamaForCausalLM", num_hidden_layers=2)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_tree_nodes_on_the_greedy_path_predict_the_chain(target: str, tmp_path: Any, monkeypatch: Any,
                                                         kind: str) -> None:
    topk, steps = 4, 4
    head = make_eagle_head(str(tmp_path / "head"), target, kind, seed=5, draft_vocab_size=1024,
                           aux_layer_ids=[0, 1, 1] if kind == "eagle3" else None)
    sched = make_scheduler(target, speculative_algorithm="eagle", speculative_draft_model_path=head,
                           speculative_num_steps=steps, speculative_num_draft_tokens=9)
    proposer = sched.speculator.proposer
    slots = proposer.pools.req_to_token.alloc(8 * topk)
    assert slots is not None
    proposer.tree_slots, proposer.num_steps = slots, steps
    records: list[dict[str, Any]] = []
    grow = tree_module.grow_draft_trees

    def recording_grow(root_logp: torch.Tensor, expand: Any, *args: Any, **kw: Any) -> list[DraftTree]:
        record: dict[str, Any] = {"root": root_logp.clone(), "expansions": []}
        records.append(record)

        def recording_expand(tokens: torch.Tensor, parents: torch.Tensor, depth: int, rows: list[int]) -> Any:
            logp = expand(tokens, parents, depth, rows)
            record["expansions"].append((tokens.clone(), parents.clone(), rows, logp.clone()))
            return logp

        return grow(root_logp, recording_expand, *args, **kw)

    monkeypatch.setattr(tree_module, "grow_draft_trees", recording_grow)
    chain_propose = proposer.propose
    checked = {"depths": [0] * (steps + 1)}

    def propose(reqs: Any) -> Any:
        saved = {rid: (s.kv_len, list(s.pending)) for rid, s in proposer.states.items()}
        proposer.topk = topk
        free_before = proposer.pools.allocator.available_size()
        trees = chain_propose(reqs)
        proposer.topk = 1
        for rid, (kv_len, pending) in saved.items():
            state = proposer.states[rid]
            proposer._truncate(state, kv_len)
            state.pending = pending
        assert proposer.pools.allocator.available_size() == free_before  # node KV freed
        chains = chain_propose(reqs)
        if records and any(isinstance(t, DraftTree) for t in trees):
            _check(records.pop(), reqs, trees, chains, proposer, checked["depths"])
        records.clear()
        return chains

    monkeypatch.setattr(proposer, "propose", propose)
    rng = random.Random(1)
    prompts = [[rng.randrange(2048) for _ in range(n)] for n in (5, 23, 40)]
    expected = generate_greedy(make_scheduler(target), prompts, 16)
    assert generate_greedy(sched, prompts, 16) == expected
    check_no_leak(sched)
    depths = checked["depths"]
    assert all(d > 0 for d in depths[1:]), depths  # every depth checked (depths 3, 4 read ancestors' KV)


def _check(record: dict[str, Any], reqs: Any, trees: list[Any], chains: list[list[int]], proposer: Any,
           depths: list[int]) -> None:
    """Follows each request's greedy path through the recorded expansions."""
    to_ids = proposer.head.to_target_ids
    active = [i for i, t in enumerate(trees) if isinstance(t, DraftTree)]
    for j, i in enumerate(active):
        tree, chain = trees[i], chains[i]
        assert len(tree.tokens) <= reqs[i].max_draft
        assert all(-1 <= p < n for n, p in enumerate(tree.parents))
        assert all(0 <= t < proposer.vocab_size for t in tree.tokens)
        if not chain:
            continue
        logp = record["root"][j]
        path = [int(logp.argmax())]
        assert int(to_ids(torch.tensor(path[-1]))) == chain[0]
        depths[1] += 1
        frontier_paths = [()]
        for tokens, parents, rows, out in record["expansions"]:
            if j not in rows:
                break
            r = rows.index(j)
            frontier_paths = [frontier_paths[p] + (t,) for t, p in zip(tokens[r].tolist(), parents[r].tolist())]
            if tuple(path) not in frontier_paths or len(path) >= len(chain):
                break
            node_logp = out[r][frontier_paths.index(tuple(path))]
            path.append(int(node_logp.argmax()))
            assert int(to_ids(torch.tensor(path[-1]))) == chain[len(path) - 1]
            depths[len(path)] += 1


@pytest.mark.parametrize("topk", [1, 3])
def test_a_full_head_pool_skips_drafts_and_keeps_the_head_aligned(target: str, tmp_path: Any, topk: int) -> None:
    head = make_eagle_head(str(tmp_path / "head"), target, seed=2)
    sched = make_scheduler(target, speculative_algorithm="eagle", speculative_draft_model_path=head,
                           speculative_eagle_topk=topk, speculative_num_steps=3, speculative_num_draft_tokens=6)
    allocator = sched.speculator.proposer.pools.allocator
    alloc_extend = allocator.alloc_extend
    calls = {"n": 0}

    def sometimes_full(*args: Any) -> Any:
        calls["n"] += 1
        return None if calls["n"] % 3 == 0 else alloc_extend(*args)  # every third catch-up finds no room

    allocator.alloc_extend = sometimes_full
    rng = random.Random(4)
    prompts = [[rng.randrange(2048) for _ in range(n)] for n in (6, 30)]
    expected = generate_greedy(make_scheduler(target), prompts, 16)
    assert generate_greedy(sched, prompts, 16) == expected
    assert calls["n"] >= 6 and sched.speculator.stats.proposed_tokens > 0
    check_no_leak(sched)
