"""A chat completion's output read back: reasoning first, then tool calls in the content.

The reasoning parser (``--reasoning-parser``) splits off ``reasoning_content``; the tool-call
parser (``--tool-call-parser``, or the reader of a forced ``tool_choice``) reads calls from what
remains. Either may be absent. Streaming feeds the content deltas of the first into the second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.parsers.reasoning import ReasoningParser
from engine.parsers.tool_calls import ToolCall, ToolCallDelta, ToolCallParser


@dataclass
class ChatOutput:
    #: None without a reasoning parser or when the model did not reason.
    reasoning: str | None
    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class ChatOutputParser:
    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None
    #: keep at most this many calls (1 when ``parallel_tool_calls`` is false).
    max_calls: int | None = None

    def parse(self, text: str) -> ChatOutput:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = self.tools.parse(text)
            calls = calls[:self.max_calls] if self.max_calls is not None else calls
        return ChatOutput(reasoning or None, text, calls)

    def stream(self) -> ChatOutputStream:
        return ChatOutputStream(self)


class ChatOutputStream:
    def __init__(self, parser: ChatOutputParser) -> None:
        self.max_calls = parser.max_calls
        self.reasoning = parser.reasoning.stream() if parser.reasoning is not None else None
        self.tools = parser.tools.stream() if parser.tools is not None else None
        #: the stream found at least one call.
        self.called = False

    def feed(self, piece: str, final: bool = False) -> ChatDelta:
        """What ``piece`` adds (``final``: it is the last, nothing is held back any more)."""
        delta = ChatDelta(content=piece)
        if self.reasoning is not None:
            delta.reasoning, delta.content = self.reasoning.feed(piece, final)
        if self.tools is not None:
            delta.content, calls = self.tools.feed(delta.content, final)
            if self.max_calls is not None:
                calls = [c for c in calls if c.index < self.max_calls]
            delta.calls = calls
            self.called = self.called or bool(calls)
        return delta
