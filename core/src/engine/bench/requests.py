"""What a benchmark sends: one request, and the slice of a tokenizer that builds requests.

Below both the dataset generators (``engine.bench.datasets``, ``engine.bench.sharegpt``) and the
backends that send them (``engine.bench.backends``), so none of those imports another for a type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class TokenizerLike(Protocol):
    """The slice of a Hugging Face tokenizer the benchmark uses."""

    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass
class BenchRequest:
    """One request to send: what to prompt with and how many tokens to ask for."""

    # Text for text-based backends, token ids for exact lengths / tokenizer-less servers.
    prompt: str | list[int]
    # Prompt length in tokens (for random text prompts: the drawn target, see
    # sample_random_requests).
    prompt_len: int
    # max_new_tokens sent to the server; with ignore_eos it is also the expected output length.
    output_len: int
    # Images sent with the prompt (data URLs), before its text; the server counts their tokens.
    images: list[str] = field(default_factory=list)
    # The LoRA adapter the request runs with (--lora-name); None is the base model.
    lora_name: str | None = None
