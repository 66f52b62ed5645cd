"""Reasoning parsers: split a model's thinking (``reasoning_content``) from its answer.

A parser implements ``parse_partial(text, final) -> (reasoning, content)``, prefix-stable like
the tool-call parsers (``engine.parsers.tool_calls``): both parts only ever grow as the output
does. ``ThinkTagReasoningParser`` covers ``<think>...</think>`` models; a plugin registers
``ReasoningParserSpec(name, factory)`` where ``factory(options=...)`` returns a parser.
"""

from __future__ import annotations

from typing import Any

from engine.parsers.scan import partial_tag_len
from engine.parsers.stream import GrowingText


class ReasoningParser:
    """Base class of reasoning parsers.

    Args:
        options: the plugin's options (``plugin_options``), declared defaults overridden.
    """

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    def parse_partial(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``, the output so far (``final``: all of it).

        Prefix-stable: for a longer text each part extends what was returned before; text
        that may still be a tag is held back until ``final``.
        """
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        return self.parse_partial(text, final=True)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """Feeds an output piece by piece; returns (new reasoning, new content)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.reasoning = GrowingText("reasoning")
        self.content = GrowingText("content")

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.text += piece
        reasoning, content = self.parser.parse_partial(self.text, final)
        return self.reasoning.advance(reasoning), self.content.advance(content)


class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning between ``start`` and ``end`` tags at the start of the output.

    With ``starts_in_reasoning`` (DeepSeek-R1 style: the chat template opens ``<think>``), the
    output is reasoning from its first token until ``end``, and all reasoning if ``end`` never
    comes; a ``start`` tag the model writes anyway is dropped. Without it (Qwen3 style: the
    model writes ``<think>`` itself), an output that does not open with ``start`` is all
    content. Whitespace around both parts is trimmed.
    """

    start = "<think>"
    end = "</think>"
    starts_in_reasoning = False

    def parse_partial(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start):]
        elif not final and self.start.startswith(stripped):
            return "", ""  # nothing yet, or the start tag still being written
        elif self.starts_in_reasoning:
            body = text
        else:
            return "", text
        at = body.find(self.end)
        if at < 0:
            hold = 0 if final else partial_tag_len(body, self.end)
            return body[:len(body) - hold].strip(), ""
        return body[:at].strip(), body[at + len(self.end):].lstrip()
