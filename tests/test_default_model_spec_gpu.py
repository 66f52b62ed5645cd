"""Speculative decoding on the GPU (default model, bf16, each CUDA attention backend): ngram and
draft = target give the plain greedy output and a full-acceptance ceiling."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.testing.default_model import CHATS, chat_prompt_ids
from engine.testing.harness import cuda_attention_backends, generate_greedy, make_scheduler

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
           "step. All that glitters is not gold. Where there is a will, there is a way.")


@pytest.fixture(scope="module")
def model_dir() -> str:
    from engine.model_executor.checkpoint import resolve_checkpoint

    return resolve_checkpoint(None)


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(model_dir)
    copy = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{PASSAGE}"}]
    return [chat_prompt_ids(tok, chat) for chat in [*CHATS, copy]]


@pytest.mark.parametrize("attention", cuda_attention_backends())
def test_ngram_equals_plain_on_gpu(model_dir: str, prompts: list[list[int]], attention: str) -> None:
    expected = generate_greedy(make_scheduler(model_dir, platform="cuda", attention=attention,
                                              max_total_tokens=20000), prompts, 64)
    sched = make_scheduler(model_dir, platform="cuda", attention=attention, max_total_tokens=20000,
                           speculative_algorithm="ngram", speculative_num_steps=8)
    got = generate_greedy(sched, prompts, 64)
    # bf16: an extend may break a near-tie differently from decode steps; say which prompt.
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g == e, f"prompt {i}: first difference at token {next(j for j, (a, b) in enumerate(zip(e, g)) if a != b)}"
    assert sched.speculator.stats.mean_accept_length() > 1.5
    check_no_leak(sched)


def test_draft_equal_to_target_accepted_in_full_on_gpu(model_dir: str, prompts: list[list[int]]) -> None:
    sched = make_scheduler(model_dir, platform="cuda", max_total_tokens=20000, speculative_algorithm="draft",
                           speculative_draft_model_path=model_dir, speculative_num_steps=4)
    generate_greedy(sched, prompts[:2], 32)
    st = sched.speculator.stats
    # Same weights, same kernels on both sides: near-total acceptance (bf16 extend vs extend).
    assert st.accepted_tokens >= 0.9 * st.proposed_tokens > 0, st
    check_no_leak(sched)
