"""``*ForSequenceClassification`` (and reward, ``num_labels=1``) heads over the Llama-family
decoder: per-sequence logits equal transformers' on tiny random checkpoints (float32, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

# float32 on the CPU through different kernels than transformers': summation order only.
ATOL = 1e-4
PAD = 3

# Rows of different lengths; one ends in padding tokens and one has padding in the middle:
# transformers scores the last token that is not padding.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, PAD, PAD], [100, PAD, 300, 400, 500, 600, 700], [42],
           [7, 1800, 33, 9, 250, 1024, 77, 8, 2000, 15, 4, 19]]


def _scores(scheduler: Any, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt's logits, through the scheduler's pooling path (prefill-only requests)."""
    from engine.testing.harness import embed_prompts

    results = embed_prompts(scheduler, prompts)
    assert [r["error"] for r in results] == [None] * len(prompts)
    return torch.tensor([r["embedding"] for r in results])


@pytest.mark.parametrize(("architecture", "num_labels", "pad_token_id"), [
    ("LlamaForSequenceClassification", 3, PAD),
    ("Qwen2ForSequenceClassification", 1, PAD),  # a reward model
    ("Qwen3ForSequenceClassification", 2, PAD),
    ("MistralForSequenceClassification", 4, None),  # no padding token: the last token of each row
])
def test_logits_match_transformers(tmp_path: Any, architecture: str, num_labels: int,
                                   pad_token_id: int | None) -> None:
    from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint
    from engine.testing.harness import make_scheduler

    model_dir = make_tiny_checkpoint(str(tmp_path), architecture, num_labels=num_labels, pad_token_id=pad_token_id)
    # Small chunks: the longest prompt is pooled over three prefill steps.
    scheduler = make_scheduler(model_dir, chunked_prefill_size=5)
    assert scheduler.runner.task == "score" and scheduler.runner.embedding_size == num_labels
    ours = _scores(scheduler, PROMPTS)
    assert ours.shape == (len(PROMPTS), num_labels) and ours.dtype == torch.float32
    hf = load_hf_model(model_dir, reference=architecture)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        err = (ours[i] - ref).abs().max().item()
        assert err <= ATOL, f"{architecture} prompt {i}: max abs logit error {err} > {ATOL} ({ours[i]} vs {ref})"
    # The head is read at the last non-padding token: padding at the end leaves the scores as they
    # are. A second round hits the radix cache (the prompts' prefixes are cached): same scores.
    if pad_token_id is not None:
        assert torch.allclose(ours[1], _scores(scheduler, [[10, 11, 12]])[0], atol=ATOL)
    again = _scores(scheduler, PROMPTS)
    assert torch.allclose(again, ours, atol=ATOL)


def test_scored_prompt_drops_trailing_padding(tmp_path: Any) -> None:
    from engine_models_llama.classification import LlamaForSequenceClassification

    from engine.testing.checkpoints import tiny_config

    config = tiny_config("LlamaForSequenceClassification", num_labels=2, pad_token_id=PAD, num_hidden_layers=1)
    model = LlamaForSequenceClassification(config)
    assert model.pooling_input([1, 2, PAD, PAD]) == [1, 2]
    assert model.pooling_input([4, PAD, 5]) == [4, PAD, 5]
    # transformers reads an all-padding sequence at its first token.
    assert model.pooling_input([PAD, PAD, PAD]) == [PAD]
    config.pad_token_id = None
    assert LlamaForSequenceClassification(config).pooling_input([1, PAD]) == [1, PAD]


def test_task_score_needs_a_head_and_embed_pools_without_it(tmp_path: Any) -> None:
    from engine.errors import ConfigError
    from engine.testing.checkpoints import make_tiny_checkpoint
    from engine.testing.harness import make_scheduler

    causal = make_tiny_checkpoint(str(tmp_path / "causal"), "LlamaForCausalLM", num_hidden_layers=1)
    with pytest.raises(ConfigError, match="--task score: .*LlamaForCausalLM has no classification head"):
        make_scheduler(causal, task="score")
    classifier = make_tiny_checkpoint(str(tmp_path / "classifier"), "Qwen2ForSequenceClassification", num_labels=3,
                                      num_hidden_layers=1)
    runner = make_scheduler(classifier, task="embed").runner
    assert runner.pooler.head is None and runner.embedding_size == 64  # the hidden size, not 3 labels
