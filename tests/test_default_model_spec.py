"""Speculative decoding on the embedded default model (SmolLM2-135M-Instruct, CPU): greedy output
with the ngram proposer equals speculation off, for chats of different lengths and a copy-heavy
prompt, with prefix-cache hits, chunked prefill and a tight KV pool."""

from __future__ import annotations

from typing import Any

import pytest

from engine.managers.scheduler import check_no_leak
from engine.testing.default_model import CHATS, chat_prompt_ids
from engine.testing.harness import generate_greedy, make_scheduler

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
           "step. All that glitters is not gold. Where there is a will, there is a way.")
COPY = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{PASSAGE}"}]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir() -> str:
    from engine.model_executor.checkpoint import resolve_checkpoint

    return resolve_checkpoint(None)


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(model_dir)
    return [chat_prompt_ids(tok, chat) for chat in [CHATS[0], CHATS[2], COPY]]


@pytest.fixture(scope="module")
def expected(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    return generate_greedy(make_scheduler(model_dir), prompts, NEW_TOKENS)


@pytest.mark.slow
def test_ngram_equals_speculation_off(model_dir: str, prompts: list[list[int]], expected: list[list[int]]) -> None:
    # Chunks of 32 tokens and a pool of 300 slots for prompts of 30-80 tokens (the copy prompt's
    # chunks interleave with the others' decode steps; the pool forces eviction of cached prefixes).
    sched = make_scheduler(model_dir, speculative_algorithm="ngram", speculative_num_steps=6,
                           chunked_prefill_size=32, max_total_tokens=300)
    assert generate_greedy(sched, prompts, NEW_TOKENS) == expected
    assert generate_greedy(sched, prompts[1:], NEW_TOKENS) == expected[1:]  # prefix-cache hits
    stats = sched.speculator.stats
    # The copy prompt is quoted back: its drafts are mostly right.
    assert stats.accepted_tokens > 0 and stats.mean_accept_length() > 1.2, stats
    check_no_leak(sched)
