"""TokenizerPool: long texts are tokenized off the event loop, over-long ones refused unread."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from engine.managers.tokenizer_pool import INLINE_MAX_CHARS, TextTooLongError, TokenizerPool


class RecordingTokenizer:
    """Splits on characters; records the thread of each call; ``delay`` stands for slow Rust work
    (time.sleep releases the GIL as the tokenizers library does)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.threads: list[str] = []

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "bb": 1, "ccc": 2}  # longest token: 3 characters

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        return [ord(c) % 3 for c in text]


def test_long_texts_run_on_a_worker_thread_short_ones_inline() -> None:
    tok = RecordingTokenizer()
    pool = TokenizerPool(tok, workers=1, context_len=10_000)

    async def main() -> tuple[list[int], list[int]]:
        return await pool.encode("ab"), await pool.encode("a" * (INLINE_MAX_CHARS + 1))

    short, long = asyncio.run(main())
    assert short == [ord("a") % 3, ord("b") % 3] and len(long) == INLINE_MAX_CHARS + 1
    assert tok.threads[0] == threading.main_thread().name and tok.threads[1].startswith("tokenizer")
    pool.close()


def test_event_loop_runs_while_a_long_text_is_tokenized() -> None:
    tok = RecordingTokenizer(delay=1.0)
    pool = TokenizerPool(tok, workers=1, context_len=10_000)
    ticks = 0

    async def ticker(stop: asyncio.Event) -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(ticker(stop))
        await pool.encode("a" * (INLINE_MAX_CHARS + 1))
        stop.set()
        await task

    asyncio.run(main())
    assert ticks > 1  # structural: the loop ran other work during the encode at all
    pool.close()


def test_over_long_text_is_refused_before_tokenizing() -> None:
    tok = RecordingTokenizer()
    pool = TokenizerPool(tok, workers=1, context_len=100)
    assert pool.max_chars == 300  # context x longest token
    with pytest.raises(TextTooLongError) as info:
        asyncio.run(pool.encode("a" * 301))
    assert "301 characters" in str(info.value) and "300" in str(info.value)
    assert tok.threads == []  # never tokenized
    assert len(asyncio.run(pool.encode("a" * 300))) == 300
    pool.close()


def test_chat_template_is_rendered_and_checked_on_the_worker() -> None:
    class ChatTokenizer(RecordingTokenizer):
        def apply_chat_template(self, conversation: list[dict[str, Any]], **kw: Any) -> str:
            self.threads.append("render:" + threading.current_thread().name)
            return "".join(m["content"] for m in conversation)

    tok = ChatTokenizer()
    pool = TokenizerPool(tok, workers=1, context_len=10_000)
    ids = asyncio.run(pool.render_chat([{"role": "user", "content": "a" * (INLINE_MAX_CHARS + 5)}]))
    assert len(ids) == INLINE_MAX_CHARS + 5
    assert tok.threads[0].startswith("render:tokenizer")
    with pytest.raises(TextTooLongError):
        asyncio.run(pool.render_chat([{"role": "user", "content": "a" * 40_000}]))
    pool.close()
