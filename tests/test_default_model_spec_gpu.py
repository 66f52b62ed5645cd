"""Speculative decoding on the GPU (default model): in float32, ngram gives the plain greedy output
exactly and draft = target is accepted in full; in bf16 (each CUDA attention backend), the outputs
are equal up to near-ties (docs/speculative_internals.md, "Exactness and floating point")."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.testing.default_model import CHATS, chat_prompt_ids
from engine.testing.harness import (
    assert_equal_up_to_near_ties,
    cuda_attention_backends,
    generate_greedy,
    make_scheduler,
)

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


def test_ngram_equals_plain_in_float32_on_gpu(model_dir: str, prompts: list[list[int]]) -> None:
    # float32: the verify extend and the decode steps agree on every argmax, so the outputs are equal.
    kw: dict[str, Any] = dict(platform="cuda", attention="triton", dtype="float32", max_total_tokens=20000)
    expected = generate_greedy(make_scheduler(model_dir, **kw), prompts, 64)
    sched = make_scheduler(model_dir, speculative_algorithm="ngram", speculative_num_steps=8, **kw)
    assert generate_greedy(sched, prompts, 64) == expected
    assert sched.speculator.stats.mean_accept_length() > 1.5
    check_no_leak(sched)


@pytest.mark.parametrize("attention", cuda_attention_backends())
def test_ngram_equals_plain_up_to_near_ties_in_bf16_on_gpu(model_dir: str, prompts: list[list[int]],
                                                           attention: str) -> None:
    # bf16 (the CUDA default): an extend may break a near-tie differently from a decode step.
    expected = generate_greedy(make_scheduler(model_dir, platform="cuda", attention=attention,
                                              max_total_tokens=20000), prompts, 64)
    sched = make_scheduler(model_dir, platform="cuda", attention=attention, max_total_tokens=20000,
                           speculative_algorithm="ngram", speculative_num_steps=8)
    got = generate_greedy(sched, prompts, 64)
    assert sched.speculator.stats.mean_accept_length() > 1.5
    check_no_leak(sched)
    assert_equal_up_to_near_ties(sched, prompts, expected, got)


def test_draft_equal_to_target_accepted_in_full_on_gpu(model_dir: str, prompts: list[list[int]]) -> None:
    sched = make_scheduler(model_dir, platform="cuda", attention="triton", dtype="float32", max_total_tokens=20000,
                           speculative_algorithm="draft", speculative_draft_model_path=model_dir,
                           speculative_num_steps=4)
    # ignore_eos: no draft is cut off by a request that ends inside its run.
    generate_greedy(sched, prompts[:2], 32, ignore_eos=True)
    st = sched.speculator.stats
    # Same weights, float32: the draft's decode steps and the target's verify extend agree.
    assert st.accepted_tokens >= 0.98 * st.proposed_tokens > 0, st
