"""Request errors and per-request state of the tokenizer manager (shared by its mixins)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError


class EngineDeadError(RuntimeError):
    """A child process of the engine died; no request can complete."""


class ServerShuttingDownError(RuntimeError):
    """The server is draining for shutdown: the request was not started, or ran past the grace period."""


class RequestError(EngineError):
    """A request is invalid; ``field`` names the offending field (for HTTP 400s)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class ReqState:
    rid: str
    prompt_ids: list[int]
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    output_token_logprobs: list[Any] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)
    input_token_logprobs: list[Any] | None = None
    input_top_logprobs: list[Any] | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_time: float | None = None
    # Set when the request is failed from outside (engine death, end of the shutdown grace period).
    error: BaseException | None = None
