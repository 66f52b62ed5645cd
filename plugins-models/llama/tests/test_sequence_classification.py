"""``*ForSequenceClassification`` (and reward, ``num_labels=1``) heads over the Llama-family
decoder: per-sequence logits equal transformers' on tiny random checkpoints (float32, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

# float32 on the CPU through different kernels than transformers': summation order only.
ATOL = 1e-4
PAD = 3

# Rows of different lengths; one ends in padding tokens and one has padding in the middle, where
# transformers scores the last token that is not padding.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, PAD, PAD], [100, PAD, 300, 400, 500, 600, 700], [42],
           [7, 1800, 33, 9, 250, 1024, 77, 8, 2000, 15, 4, 19]]


def _extend_forward(model_dir: str, prompts: list[list[int]]) -> Any:
    """The model's output of one EXTEND forward over ``prompts`` (no cache)."""
    from engine.testing.harness import make_scheduler

    runner = make_scheduler(model_dir).runner
    lens = [len(p) for p in prompts]
    slots = runner.req_to_token_pool.alloc(len(prompts))
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0] * len(lens), lens, [-1] * len(lens))
    offset = 0
    for slot, n in zip(slots, lens):
        runner.req_to_token_pool.write(slot, 0, loc[offset: offset + n])
        offset += n
    fb = ForwardBatch.build(ForwardMode.EXTEND, [t for p in prompts for t in p], slots, lens, [0] * len(lens),
                            loc, runner.device)
    return runner.forward(fb)


@pytest.mark.parametrize(("architecture", "num_labels", "pad_token_id"), [
    ("LlamaForSequenceClassification", 3, PAD),
    ("Qwen2ForSequenceClassification", 1, PAD),  # a reward model
    ("Qwen3ForSequenceClassification", 2, PAD),
    ("MistralForSequenceClassification", 4, None),  # no padding token: the last token of each row
])
def test_logits_match_transformers(tmp_path: Any, architecture: str, num_labels: int,
                                   pad_token_id: int | None) -> None:
    from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(str(tmp_path), architecture, num_labels=num_labels, pad_token_id=pad_token_id)
    ours = _extend_forward(model_dir, PROMPTS)
    assert ours.shape == (len(PROMPTS), num_labels) and ours.dtype == torch.float32
    hf = load_hf_model(model_dir, reference=architecture)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        err = (ours[i] - ref).abs().max().item()
        assert err <= ATOL, f"{architecture} prompt {i}: max abs logit error {err} > {ATOL} ({ours[i]} vs {ref})"
    # The head is read at the last non-padding token: padding at the end leaves the scores as they are.
    if pad_token_id is not None:
        assert torch.allclose(ours[1], _extend_forward(model_dir, [[10, 11, 12]])[0], atol=ATOL)


def test_rows_pick_the_last_non_padding_token() -> None:
    from engine_models_llama.classification import last_non_pad_rows

    prompts = [[1, 2, PAD], [PAD, PAD], [4, PAD, 5], [6]]
    lens = [len(p) for p in prompts]
    fb = ForwardBatch.build(ForwardMode.EXTEND, [t for p in prompts for t in p], [0, 1, 2, 3], lens,
                            [0] * len(lens), torch.zeros(sum(lens), dtype=torch.int64), "cpu")
    # Rows start at 0, 3, 5, 8: an all-padding row is read at its first token, as transformers does.
    assert last_non_pad_rows(fb, PAD).tolist() == [1, 3, 7, 8]
    assert last_non_pad_rows(fb, None).tolist() == [2, 4, 7, 8]
