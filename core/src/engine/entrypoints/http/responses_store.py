"""The in-memory store of ``/v1/responses``: what ``previous_response_id``, ``GET`` and cancel read.

Bounded by a count (``--responses-store-size``, default 1000): storing one more evicts the
least recently used response, where storing and reading (``GET``, ``previous_response_id``)
count as use. A background response still running is never evicted (its task would finish
into nothing); it becomes evictable once done. The store lives in the server process and is
lost when the server stops.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    #: the response object, as GET returns it (updated in place while a background one runs).
    response: dict[str, Any]
    #: the conversation a follow-up continues: every earlier turn's input and this one's
    #: output, as chat messages (the instructions are not carried over, as OpenAI does).
    conversation: list[dict[str, Any]] = field(default_factory=list)
    #: the engine request id (cancel aborts it).
    rid: str | None = None
    #: the request's input items, each with an ``id`` (``GET /v1/responses/{id}/input_items``).
    input_items: list[dict[str, Any]] = field(default_factory=list)
    #: a background response's task, None otherwise.
    task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, entry: StoredResponse) -> None:
        """Stores (or replaces) ``entry``, then evicts the least recently used beyond the bound."""
        if self.capacity <= 0:
            return
        response_id = entry.response["id"]
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        excess = len(self._entries) - self.capacity
        for key in [k for k, e in self._entries.items() if not e.running and k != response_id][:max(excess, 0)]:
            del self._entries[key]

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None when unknown or evicted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> StoredResponse | None:
        return self._entries.pop(response_id, None)


def store_of(state: Any) -> ResponseStore:
    """The app's store (``app.state``), made on first use with ``--responses-store-size``."""
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore(state.ctx.args.responses_store_size)
    return state.responses  # type: ignore[no-any-return]
