"""Prompts the tests put to the embedded default model (SmolLM2-135M-Instruct), and how they
become token ids: the same three chats everywhere the default model's answers are compared."""

from __future__ import annotations

from typing import Any

#: Three chats: a fact ("Paris"), a list, and one with a system prompt.
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "How many legs does a spider have?"}],
]
#: New tokens generated per chat when answers are compared.
MAX_NEW_TOKENS = 24


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """``messages`` through the tokenizer's chat template, with the generation prompt, as ids
    (transformers returns a list or, in newer releases, a BatchEncoding)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)
