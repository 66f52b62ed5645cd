from __future__ import annotations

import random
from typing import Any

import pytest

from engine.managers.scheduler import check_no_leak
from engine.testing import SpeculativeProposerConformance
from engine.testing.harness import generate_greedy, make_scheduler


class TestDraftIsTarget(SpeculativeProposerConformance):
    """The kit with the target as its own draft model."""

    algorithm_name = "draft"
    server_args = {"speculative_draft_model_path": "{tiny_model_path}", "speculative_num_steps": 3}


@pytest.fixture(scope="module")
def target(tmp_path_factory: Any) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("target")), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: Any) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("draft")), "LlamaForCausalLM", seed=5, num_hidden_layers=1)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(2048) for _ in range(n)] for n in (4, 37, 12)]


def test_draft_equal_to_target_is_accepted_in_full(target: str) -> None:
    prompts = _prompts()
    expected = generate_greedy(make_scheduler(target), prompts, 20)
    sched = make_scheduler(target, speculative_algorithm="draft", speculative_draft_model_path=target,
                           speculative_num_steps=4)
    assert generate_greedy(sched, prompts, 20) == expected
    st = sched.speculator.stats
    assert st.accepted_tokens == st.proposed_tokens > 0
    check_no_leak(sched)


def test_a_different_draft_model_is_still_exact(target: str, other_draft: str) -> None:
    prompts = _prompts()
    expected = generate_greedy(make_scheduler(target), prompts, 20)
    sched = make_scheduler(target, speculative_algorithm="draft", speculative_draft_model_path=other_draft,
                           speculative_num_steps=3, chunked_prefill_size=16)
    for _ in range(2):
        assert generate_greedy(sched, prompts, 20) == expected
    check_no_leak(sched)
    proposer = sched.speculator.proposer
    proposer.propose([])  # requests gone: their draft state and KV go too
    assert proposer.runner.token_to_kv_pool_allocator.available_size() == proposer.runner.max_total_num_tokens


def test_draft_model_path_is_required(target: str) -> None:
    from engine.config import ServerArgs
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="--speculative-draft-model-path"):
        ServerArgs.from_dict({"model_path": target, "speculative_algorithm": "draft"})
