"""A response's output items and its streaming events, built from the output as it is read.

``ResponseWriter.feed`` takes what each piece of output adds (reasoning, text, tool-call
deltas, as the chat route's output parser reads them) and returns the events OpenAI's
Responses API sends for it, in its order: an item is announced (``response.output_item.added``,
then ``response.content_part.added`` for text), grows (``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``) and is closed
(the ``.done`` events, then ``response.output_item.done``) when the next kind of item begins or
the output ends. Every event carries a ``sequence_number``. The non-streamed response is the
same writer's final ``response`` object, so the two cannot differ.
"""

from __future__ import annotations

import copy
import secrets
from typing import Any

from engine.parsers import ChatDelta


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ResponseWriter:
    def __init__(self, response: dict[str, Any]) -> None:
        #: the response object; ``output`` grows as items are added.
        self.response = response
        self.items: list[dict[str, Any]] = response["output"]
        self.sequence = 0
        # The open text item (a message or a reasoning item) and the calls still open, by call index.
        self._text_item: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        # Whitespace before anything else of a message (often a newline before a tool call)
        # opens no message; it is written once text follows.
        self._pending = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        snapshot = copy.deepcopy(self.response)
        return [self.event("response.created", response=snapshot), self.event("response.in_progress", response=snapshot)]

    # -- output as it arrives ---------------------------------------------------------------
    def feed(self, delta: ChatDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._content(delta.content)
        for call in delta.calls:
            if call.id is not None:
                events += self._close_text()
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": call.id, "name": call.name, "arguments": ""}
                self._calls[call.index] = item
                events += self._add(item)
            item = self._calls.get(call.index)
            if item is not None and call.arguments:
                item["arguments"] += call.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.items.index(item), delta=call.arguments))
        return events

    def _content(self, text: str) -> list[dict[str, Any]]:
        item = self._text_item
        if (item is None or item["type"] != "message") and not (self._pending + text).strip():
            self._pending += text
            return []
        text, self._pending = self._pending + text, ""
        return self._text("message", text)

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._text_item
        if item is None or item["type"] != kind:
            events += self._close_text() + self._close_calls()
            if kind == "message":
                item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}
                part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            self._text_item = item
            events += self._add(item)
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=self.items.index(item), content_index=0, part=dict(part)))
        part = item["content"][0]
        part["text"] += text
        kind_name = "output_text" if kind == "message" else "reasoning_text"
        fields: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(f"response.{kind_name}.delta", item_id=item["id"],
                                 output_index=self.items.index(item), content_index=0, delta=text, **fields))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))]

    # -- closing items ------------------------------------------------------------------------
    def _close_text(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._text_item = self._text_item, None
        if item is None:
            return []
        index = self.items.index(item)
        part = item["content"][0]
        item["status"] = status
        if item["type"] == "message":
            done = self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=part["text"], logprobs=[])
        else:
            done = self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=part["text"])
        return [done,
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=dict(part)),
                self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _close_calls(self, status: str = "completed") -> list[dict[str, Any]]:
        events = []
        for item in self._calls.values():
            index = self.items.index(item)
            if not item["arguments"]:
                item["arguments"] = "{}"  # a call without arguments takes none (as the chat route says)
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=index, delta="{}"))
            item["status"] = status
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
        self._calls = {}
        return events

    def finish(self, status: str, usage: dict[str, Any] | None, error: dict[str, Any] | None = None,
               incomplete_reason: str | None = None, completed_at: int | None = None) -> list[dict[str, Any]]:
        """Closes every open item and ends the response: ``response.completed``, ``.incomplete``
        (``incomplete_reason``, e.g. max_output_tokens) or ``.failed`` (``error``)."""
        item_status = "completed" if status == "completed" else "incomplete"
        if not self.items and not self._text_item and status == "completed":
            self._text("message", self._pending)  # an empty answer is still a message
            self._pending = ""
        events = self._close_text(item_status) + self._close_calls(item_status)
        self.response.update(status=status, usage=usage, error=error,
                             incomplete_details={"reason": incomplete_reason} if incomplete_reason else None,
                             completed_at=completed_at if status == "completed" else None)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        if status == "cancelled":
            return events  # no event: a cancelled response is read with GET
        return events + [self.event(kind, response=copy.deepcopy(self.response))]

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning" and i["content"])


def conversation_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages a follow-up turn continues from (reasoning dropped)."""
    out: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            out.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return out
