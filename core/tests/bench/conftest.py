"""Shared fixtures for the bench tests: a word-level tokenizer that needs no download."""

from __future__ import annotations

import pytest


class WordTokenizer:
    """Tokens are whitespace-separated words ``w<id>``; id 0 is a special (BOS-like) token.

    Unknown words encode to id 1 so any text has a well-defined token count (one per word).
    """

    vocab_size = 100
    all_special_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for word in text.split():
            number = word[1:]
            ids.append(int(number) if word.startswith("w") and number.isdigit() else 1)
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"w{int(i)}" for i in token_ids)


@pytest.fixture
def word_tokenizer() -> WordTokenizer:
    """A fresh WordTokenizer."""
    return WordTokenizer()
