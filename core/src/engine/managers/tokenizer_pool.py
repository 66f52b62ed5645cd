"""Tokenization off the event loop: a bounded thread pool, and a cheap length bound.

Why threads and not processes (measured on the embedded model, docs/benchmarks.md):
transformers' fast-tokenizer ``encode`` goes through ``encode_batch``, whose Rust
part releases the GIL — a 10 MB prompt tokenized on a worker thread left the event
loop's longest pause at 0.4 s (the Python conversion of 2.2 M ids) where the same
call on the loop froze it for 15 s. Chat-template rendering (jinja, which holds the
GIL) took 0.01 s for a 10 MB message, so it rides along on the worker. A process
pool would cost a tokenizer load and ~300 MB per worker and a pickle round trip per
request for isolation the length bound below already gives.

Two more defences:
- ``max_chars``: a text longer than the context can hold even if every token were
  the vocabulary's longest is refused before any tokenizing (huge prompts cost a
  ``len()``, not seconds of CPU and a gigabyte of memory).
- After a large job the pool hands freed heap back to the OS (glibc ``malloc_trim``),
  so a burst of big prompts does not leave the server's memory high for good.

Short texts are tokenized inline: a hop to a thread costs more than the work, and
it keeps small requests from queueing behind large ones in the pool.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Texts up to this many characters are tokenized on the calling thread (well under 1 ms of work).
INLINE_MAX_CHARS = 2048
# After jobs on at least this many characters, return freed heap memory to the OS.
_TRIM_AFTER_CHARS = 1 << 20


class TextTooLongError(ValueError):
    """A text is longer than the context could hold at the vocabulary's longest token."""

    def __init__(self, chars: int, max_chars: int, context_len: int) -> None:
        super().__init__(
            f"the prompt has {chars} characters; this model's context of {context_len} tokens holds at most "
            f"{max_chars} characters (even at the longest token of the vocabulary), so it was refused "
            "before tokenizing")
        self.chars = chars
        self.max_chars = max_chars


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token string: an upper bound on characters per token.

    Byte-level vocabularies spell each byte as one character, so a token's string is
    at least as long as the text it stands for.
    """
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: no bound
        return 0
    return max((len(t) for t in vocab), default=0)


class TokenizerPool:
    """Runs tokenizer work on ``workers`` threads; ``workers`` 0 runs it inline (offline use)."""

    def __init__(self, tokenizer: Any | None, workers: int, context_len: int) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.workers = workers
        per_token = longest_token_chars(tokenizer) if tokenizer is not None else 0
        # 0 means no bound can be derived (then only the body limit applies).
        self.max_chars = context_len * per_token if per_token else 0
        self._executor = (ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenizer")
                          if workers > 0 else None)
        # Jobs submitted and not finished (graceful shutdown waits for them).
        self.in_flight = 0
        self._trim_lock = threading.Lock()

    def check_length(self, text: str) -> None:
        """Raises TextTooLongError when ``text`` cannot fit the context whatever it tokenizes to."""
        if self.max_chars and len(text) > self.max_chars:
            raise TextTooLongError(len(text), self.max_chars, self.context_len)

    def encode_sync(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Length check and tokenization on the calling thread."""
        self.check_length(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat_sync(self, conversation: list[dict[str, Any]], add_generation_prompt: bool,
                         template_kwargs: dict[str, Any]) -> list[int]:
        """Chat template, then the length check on the rendered text, then tokenization."""
        prompt = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt,
                                                    **template_kwargs)
        # The template writes any BOS itself; adding special tokens again would double it.
        return self.encode_sync(prompt, add_special_tokens=False)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_length(text)  # before queueing: a refused text costs nothing
        return await self.run(self.encode_sync, len(text), text, add_special_tokens)

    async def render_chat(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        size = sum(len(str(m.get("content") or "")) for m in conversation)
        return await self.run(self.render_chat_sync, size, conversation, add_generation_prompt,
                              template_kwargs or {})

    async def run(self, fn: Callable[..., T], size: int, *args: Any) -> T:
        """``fn(*args)`` inline when small (or without workers), else on a worker thread.

        ``size`` is the job's characters: it picks the lane and whether to trim memory after.
        """
        if self._executor is None or size <= INLINE_MAX_CHARS:
            return fn(*args)
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._job, fn, size, args)
        finally:
            self.in_flight -= 1

    def _job(self, fn: Callable[..., T], size: int, args: tuple[Any, ...]) -> T:
        try:
            return fn(*args)
        finally:
            if size >= _TRIM_AFTER_CHARS:
                self._trim()

    def _trim(self) -> None:
        # The ids and offsets of a multi-megabyte text are freed but stay in the heap otherwise.
        with self._trim_lock:
            trim = _malloc_trim()
            if trim is not None:
                trim(0)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


@functools.cache
def _malloc_trim() -> Any | None:
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS); looked up once."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
