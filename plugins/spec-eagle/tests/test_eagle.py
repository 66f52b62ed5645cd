from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.testing import SpeculativeProposerConformance
from engine.testing.harness import generate_greedy, make_scheduler
from engine_spec_eagle.testing import make_bigram_target, make_copying_eagle_head, make_eagle_head


class TestEagleKit(SpeculativeProposerConformance):
    """The kit with a random EAGLE-1 head written next to the kit's tiny target."""

    algorithm_name = "eagle"
    server_args = {"speculative_num_steps": 3}

    def _args(self, path: str) -> dict[str, Any]:
        head = os.path.join(path, "eagle_head")
        if not os.path.isdir(head):
            make_eagle_head(head, path)
        return {**super()._args(path), "speculative_draft_model_path": head}


@pytest.fixture(scope="module")
def target(tmp_path_factory: Any) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("target")), "LlamaForCausalLM", num_hidden_layers=4)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    phrase = [rng.randrange(2048) for _ in range(9)]
    return [[rng.randrange(2048) for _ in range(4)], phrase * 4, [rng.randrange(2048) for _ in range(37)]]


@pytest.mark.parametrize("kind,layout", [("eagle", "safetensors"), ("eagle", "bin"), ("eagle3", "safetensors"),
                                         ("eagle3", "bin")])
def test_random_heads_load_and_stay_exact(target: str, tmp_path: Any, kind: str, layout: str) -> None:
    head = make_eagle_head(str(tmp_path / "head"), target, kind, seed=7, layout=layout, draft_vocab_size=1024,
                           aux_layer_ids=[0, 1, 2] if kind == "eagle3" else None)
    prompts = _prompts()
    expected = generate_greedy(make_scheduler(target), prompts, 20)
    sched = make_scheduler(target, speculative_algorithm="eagle", speculative_draft_model_path=head,
                           speculative_num_steps=3, chunked_prefill_size=16)
    for _ in range(2):  # the second round hits the prefix cache
        assert generate_greedy(sched, prompts, 20) == expected
    check_no_leak(sched)
    st = sched.speculator.stats
    assert st.proposed_tokens > 0  # the head drafted
    proposer = sched.speculator.proposer
    assert proposer.head.eagle3 == (kind == "eagle3")
    assert sched.runner.capture_hidden == ((0, 1, 2) if kind == "eagle3" else ())
    for rid in list(proposer.states):
        proposer.release(rid)
    assert proposer.pools.allocator.available_size() == proposer.pools.kv.size


def test_eagle3_default_aux_layers_are_low_mid_high(target: str, tmp_path: Any) -> None:
    head = make_eagle_head(str(tmp_path / "head"), target, "eagle3")
    sched = make_scheduler(target, speculative_algorithm="eagle", speculative_draft_model_path=head)
    assert sched.runner.capture_hidden == (1, 1, 0)  # 1, L/2 - 1, L - 4 for L = 4


def test_a_head_that_copies_the_target_is_accepted_in_full(tmp_path: Any) -> None:
    target = make_bigram_target(str(tmp_path / "target"))
    head = make_copying_eagle_head(str(tmp_path / "head"), target)
    prompts = _prompts()
    expected = generate_greedy(make_scheduler(target), prompts, 24)
    sched = make_scheduler(target, speculative_algorithm="eagle", speculative_draft_model_path=head,
                           speculative_num_steps=4)
    assert generate_greedy(sched, prompts, 24) == expected
    st = sched.speculator.stats
    assert st.proposed_tokens > 0 and st.accepted_tokens == st.proposed_tokens
    assert st.mean_accept_length() > 4.0
    check_no_leak(sched)


def test_bad_head_is_refused_with_the_tensor_named(target: str, tmp_path: Any) -> None:
    from safetensors.torch import load_file, save_file

    from engine.errors import ModelLoadError

    head = make_eagle_head(str(tmp_path / "head"), target)
    path = os.path.join(head, "model.safetensors")
    weights = load_file(path)
    weights["layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    save_file(weights, path)
    with pytest.raises(ModelLoadError, match="bogus"):
        make_scheduler(target, speculative_algorithm="eagle", speculative_draft_model_path=head)


def _tree_scheduler(target: str, head: str, topk: int, **kw: Any) -> Any:
    """A scheduler whose EAGLE proposer grows trees of branching ``topk``."""
    sched = make_scheduler(target, speculative_algorithm="eagle", speculative_draft_model_path=head,
                           speculative_eagle_topk=topk, **kw)
    proposer = sched.speculator.proposer
    assert proposer.topk == topk and len(proposer.tree_slots) == topk * sched.speculator.max_batch_size
    return sched


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("topk", [2, 4])
def test_random_head_trees_equal_plain_greedy(target: str, tmp_path: Any, kind: str, topk: int) -> None:
    head = make_eagle_head(str(tmp_path / "head"), target, kind, seed=7, draft_vocab_size=1024,
                           aux_layer_ids=[0, 1, 2] if kind == "eagle3" else None)
    prompts = _prompts()
    expected = generate_greedy(make_scheduler(target), prompts, 20)
    sched = _tree_scheduler(target, head, topk, speculative_num_steps=3, speculative_num_draft_tokens=8,
                            chunked_prefill_size=16)
    for _ in range(2):  # the second round hits the prefix cache
        assert generate_greedy(sched, prompts, 20) == expected
    check_no_leak(sched)
    st = sched.speculator.stats
    assert st.proposed_tokens > 0 and st.tree_steps > 0
    proposer = sched.speculator.proposer
    for rid in list(proposer.states):
        proposer.release(rid)
    assert proposer.pools.allocator.available_size() == proposer.pools.kv.size


def test_copying_head_accepts_more_with_a_tree_than_a_random_head(tmp_path: Any) -> None:
    # A peaked target (lm_head_scale): the copying head's best path dominates its tree, so the
    # greedy path is kept to full depth; with the flat default target the tree spends its nodes on
    # near-equal siblings instead.
    target = make_bigram_target(str(tmp_path / "target"), lm_head_scale=40.0)
    prompts = _prompts()
    expected = generate_greedy(make_scheduler(target), prompts, 24)
    accept = {}
    for name, head in (("copying", make_copying_eagle_head(str(tmp_path / "copying"), target)),
                       ("random", make_eagle_head(str(tmp_path / "random"), target, seed=3))):
        sched = _tree_scheduler(target, head, 2, speculative_num_steps=4, speculative_num_draft_tokens=8)
        assert generate_greedy(sched, prompts, 24) == expected
        check_no_leak(sched)
        st = sched.speculator.stats
        assert st.tree_steps > 0
        accept[name] = st.mean_accept_length()
    assert accept["copying"] > 4.0 > accept["random"], accept


def test_overlap_stays_off_with_a_proposer_that_reads_hidden_states(target: str, tmp_path: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """On a platform with overlap scheduling, ngram keeps it (for batches above the speculation
    limit) but EAGLE, which reads every target forward's hidden states in step order, turns it off."""
    from engine_platform_cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "supports_overlap_schedule", lambda self: True)
    assert make_scheduler(target, speculative_algorithm="ngram").enable_overlap
    head = make_eagle_head(str(tmp_path / "head"), target, "eagle")
    assert not make_scheduler(target, speculative_algorithm="eagle", speculative_draft_model_path=head).enable_overlap
