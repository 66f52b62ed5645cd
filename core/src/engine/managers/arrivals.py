"""Which HTTP requests the server received before its drain began.

A graceful shutdown finishes every request the server had received when it began to drain,
not only those already handed to the scheduler: a request whose body was still being read,
whose prompt waited for a tokenizer worker, or whose handler had not reached the tokenizer
manager yet is drained like a scheduled one. Only requests that arrive after the drain began
are refused.

The HTTP front door calls ``arrive`` for each request (it runs in the request's context, so
every coroutine the handler awaits sees the answer) and ``leave`` when it is answered; the
tokenizer manager asks ``admitted`` and waits for ``open`` to reach zero while it drains.
"""

from __future__ import annotations

import contextvars
import time

# The Arrivals that admitted the request running in this context (None: not admitted).
_ADMITTED: contextvars.ContextVar[Arrivals | None] = contextvars.ContextVar("engine_admitted", default=None)


class Arrivals:
    """Requests received and not yet answered, counted from their arrival at the front door."""

    def __init__(self) -> None:
        self.open = 0  # admitted requests whose handler has not returned
        self.drain_started: float | None = None  # time.monotonic() when the drain began
        self.closed = False  # the grace period is over: nobody is admitted any more

    def arrive(self) -> bool:
        """Records a request arriving in the current context; True when it is admitted (the
        drain had not begun). An admitted request must be ended with ``leave``."""
        if self.drain_started is not None:
            _ADMITTED.set(None)
            return False
        _ADMITTED.set(self)
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1

    def begin_drain(self) -> None:
        if self.drain_started is None:
            self.drain_started = time.monotonic()

    def close(self) -> None:
        """The grace period is over: even requests received before the drain are refused now."""
        self.closed = True

    def admitted(self) -> bool:
        """Whether the request running in this context arrived before the drain began (and the
        grace period is not over)."""
        return not self.closed and _ADMITTED.get() is self


__all__ = ["Arrivals"]
