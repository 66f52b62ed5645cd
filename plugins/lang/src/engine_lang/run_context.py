"""What a program's state and all its forks share: the backend, the run's sampling defaults, and
the requests in flight, so that a failure or Ctrl-C aborts every one of them."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from engine_lang.backends.base import Backend, RequestAborted
from engine_lang.chat_template import ChatTemplate


class ProgramError(RuntimeError):
    """A gen/select/role of a program failed: names the variable and the call.

    ``variable`` and ``call`` hold them; ``__cause__`` is the backend's error.
    """

    def __init__(self, call: str, variable: str | None, cause: BaseException) -> None:
        where = f"variable {variable!r}: " if variable else ""
        super().__init__(f"{where}{call} failed: {type(cause).__name__}: {cause}")
        self.call = call
        self.variable = variable


class RunContext:
    def __init__(self, backend: Backend, sampling: dict[str, Any], logprobs: dict[str, Any], stream: bool) -> None:
        self.backend = backend
        # The run's defaults; a gen's own arguments override them.
        self.sampling = sampling
        self.logprobs = logprobs
        self.stream = stream
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self.cancelled = False
        self._template: ChatTemplate | None = None
        # Every state of the run (the root and its forks): their worker threads end with the run.
        self.states: list[Any] = []

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = self.backend.chat_template()
        return self._template

    @staticmethod
    def new_rid() -> str:
        return f"lang-{uuid.uuid4().hex}"

    def begin(self, rid: str) -> None:
        with self._lock:
            if self.cancelled:
                raise RequestAborted("the program was stopped (an earlier call failed or it was interrupted)")
            self._inflight.add(rid)

    def end(self, rid: str) -> None:
        with self._lock:
            self._inflight.discard(rid)

    def cancel(self) -> None:
        """Refuses new requests and aborts those in flight (on an error or KeyboardInterrupt)."""
        with self._lock:
            self.cancelled = True
            rids = sorted(self._inflight)
        for rid in rids:
            try:
                self.backend.abort(rid)
            except Exception:  # noqa: BLE001 - abort is best effort; the original error matters
                pass

    def stop_workers(self) -> None:
        for state in list(self.states):
            state._stop_worker()
