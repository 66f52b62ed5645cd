"""Reading a streamed program's text as it is generated (``run(stream=True)``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any


class StreamingMixin:
    """``text_iter`` and ``text_async_iter`` over the (variable, text) pieces a state appends."""

    _run: Any
    _cond: threading.Condition
    _chunks: list[tuple[str | None, str]]
    _finished: bool
    _error: BaseException | None

    # -- streaming -------------------------------------------------------------------------------
    def _take(self, seen: int, var_name: str | None) -> tuple[list[str], int, bool]:
        """The chunks appended since ``seen`` (``var_name``'s only, if given), the new count, and
        whether the stream has ended with nothing left to read."""
        with self._cond:
            new, seen = self._chunks[seen:], len(self._chunks)
            done = self._finished and not new
        return [text for variable, text in new if var_name is None or variable == var_name], seen, done

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """With ``run(stream=True)``: the text as it is appended (only ``var_name``'s if given)."""
        if not self._run.stream:
            raise RuntimeError("text_iter: run the program with stream=True")
        seen = 0
        try:
            while True:
                with self._cond:
                    while seen >= len(self._chunks) and not self._finished:
                        self._cond.wait(0.1)
                texts, seen, done = self._take(seen, var_name)
                yield from texts
                if done:
                    break
        except KeyboardInterrupt:
            self._run.cancel()  # the program runs in its own thread: Ctrl-C here stops its requests
            raise
        if self._error is not None:
            raise self._error

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """``text_iter`` for asyncio code (polls without blocking the event loop)."""
        if not self._run.stream:
            raise RuntimeError("text_async_iter: run the program with stream=True")
        seen = 0
        try:
            while True:
                before = seen
                texts, seen, done = self._take(seen, var_name)
                for text in texts:
                    yield text
                if done:
                    break
                if seen == before:
                    await asyncio.sleep(0.01)
        except (KeyboardInterrupt, asyncio.CancelledError):
            self._run.cancel()
            raise
        if self._error is not None:
            raise self._error
