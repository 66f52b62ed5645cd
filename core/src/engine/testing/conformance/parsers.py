"""``ToolCallParserConformance`` and ``ReasoningParserConformance``: a parser reads its recorded
outputs right, whole and streamed with every chunk boundary.

Set ``parser_name`` and ``cases`` (recorded model outputs with what they must parse to). The
kit checks that the non-streamed parse gives the expected content and calls (arguments compared
as JSON), and that streaming the output split at every position (and one character at a time,
and in random three-piece splits) yields the same content and calls as the non-streamed parse,
with each call announced once (id, type and name on its first delta only). Splits fall inside
tags and inside JSON strings and numbers, so a parser that sends text it later takes back fails.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine import plugins

_SEED = 1234
_RANDOM_SPLITS = 40


@dataclass(frozen=True)
class ToolCallCase:
    """A recorded output and what it must parse to."""

    output: str
    #: the content; compared with surrounding whitespace stripped.
    content: str = ""
    #: (name, arguments) of each call, arguments as the decoded JSON object.
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    #: a few words on where it comes from (shown on failure).
    label: str = ""


@dataclass(frozen=True)
class ReasoningCase:
    output: str
    reasoning: str
    content: str
    label: str = ""


def _splits(text: str, seed: int) -> list[list[str]]:
    """Every two-piece split, the one-character split and random three-piece splits."""
    pieces = [[text[:k], text[k:]] for k in range(len(text) + 1)]
    pieces.append(list(text))
    rng = random.Random(seed)
    for _ in range(_RANDOM_SPLITS if len(text) > 2 else 0):
        a, b = sorted(rng.sample(range(1, len(text)), 2))
        pieces.append([text[:a], text[a:b], text[b:]])
    return pieces


def _where(parts: list[str]) -> str:
    return "split " + " | ".join(repr(p) for p in parts) if len(parts) <= 3 else "one character at a time"


@dataclass
class _Streamed:
    content: str = ""
    names: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)


class ToolCallParserConformance:
    """Set ``parser_name`` and ``cases`` (``ToolCallCase``); optionally ``plain_texts``."""

    parser_name: ClassVar[str] = ""
    cases: ClassVar[tuple[ToolCallCase, ...]] = ()
    #: outputs without calls: their content must come through unchanged (whitespace trimmed).
    plain_texts: ClassVar[tuple[str, ...]] = (
        "The capital of France is Paris.",
        "Sure! Three primary colors:\n1. red\n2. blue\n3. yellow",
        "",
    )

    def _parser(self) -> Any:
        from engine.parsers import ToolCallParser

        parser = plugins.create_tool_call_parser(self.parser_name)
        assert isinstance(parser, ToolCallParser), f"the factory of '{self.parser_name}' must build a ToolCallParser"
        return parser

    def test_has_cases(self) -> None:
        assert self.parser_name in plugins.tool_call_parsers(), f"'{self.parser_name}' is not registered"
        assert any(c.calls for c in self.cases), "give recorded outputs with calls in ``cases``"

    def test_parses_recorded_outputs(self) -> None:
        parser = self._parser()
        for case in self.cases:
            content, calls = parser.parse(case.output)
            where = case.label or repr(case.output[:60])
            assert content.strip() == case.content.strip(), where
            assert [(c.name, json.loads(c.arguments)) for c in calls] == [(n, a) for n, a in case.calls], where

    def test_streams_like_it_parses_at_every_boundary(self) -> None:
        parser = self._parser()
        for n, case in enumerate(self.cases):
            content, calls = parser.parse(case.output)
            for parts in _splits(case.output, _SEED + n):
                got = self._stream(parser, parts)
                where = f"{case.label or repr(case.output[:60])}, {_where(parts)}"
                assert got.content == content, where
                assert got.names == [c.name for c in calls], where
                assert got.arguments == [c.arguments for c in calls], where
                assert len(set(got.ids)) == len(got.ids), f"call ids repeat: {where}"

    def test_plain_text_is_content(self) -> None:
        parser = self._parser()
        for text in self.plain_texts:
            content, calls = parser.parse(text)
            assert calls == [] and content.strip() == text.strip(), repr(text)
            streamed = self._stream(parser, list(text) or [""])
            assert streamed.content == content and not streamed.names, repr(text)

    def test_rendered_calls_parse_back(self) -> None:
        from engine.parsers import ToolCall

        parser = self._parser()
        calls = [ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3})),
                 ToolCall("search", json.dumps({"query": "a \"quoted\" {brace} [x]", "tags": ["a", "b"], "n": None}))]
        for some in (calls[:1], calls):
            _, back = parser.parse(parser.render_calls(some))
            assert [(c.name, json.loads(c.arguments)) for c in back] == [(c.name, json.loads(c.arguments)) for c in some]

    def test_tool_prompt_names_the_tools(self) -> None:
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
        prompt = self._parser().tool_prompt(tools)
        assert isinstance(prompt, str) and "get_weather" in prompt

    @staticmethod
    def _stream(parser: Any, parts: list[str]) -> _Streamed:
        stream, out = parser.stream(), _Streamed()
        for k, part in enumerate(parts):
            content, deltas = stream.feed(part, final=k == len(parts) - 1)
            out.content += content
            for d in deltas:
                if d.id is not None:
                    assert d.index == len(out.names), f"call {d.index} announced out of order"
                    assert d.name, "a call's first delta must carry its name"
                    out.ids.append(d.id)
                    out.names.append(d.name)
                    out.arguments.append(d.arguments)
                else:
                    assert d.index < len(out.names), f"arguments of call {d.index} before its name"
                    out.arguments[d.index] += d.arguments
        out.arguments = [a or "{}" for a in out.arguments]
        return out


class ReasoningParserConformance:
    """Set ``parser_name`` and ``cases`` (``ReasoningCase``)."""

    parser_name: ClassVar[str] = ""
    cases: ClassVar[tuple[ReasoningCase, ...]] = ()

    def _parser(self) -> Any:
        from engine.parsers import ReasoningParser

        parser = plugins.create_reasoning_parser(self.parser_name)
        assert isinstance(parser, ReasoningParser), f"the factory of '{self.parser_name}' must build a ReasoningParser"
        return parser

    def test_has_cases(self) -> None:
        assert self.parser_name in plugins.reasoning_parsers(), f"'{self.parser_name}' is not registered"
        assert any(c.reasoning for c in self.cases), "give recorded outputs with reasoning in ``cases``"

    def test_parses_recorded_outputs(self) -> None:
        parser = self._parser()
        for case in self.cases:
            reasoning, content = parser.parse(case.output)
            where = case.label or repr(case.output[:60])
            assert (reasoning.strip(), content.strip()) == (case.reasoning.strip(), case.content.strip()), where

    def test_streams_like_it_parses_at_every_boundary(self) -> None:
        parser = self._parser()
        for n, case in enumerate(self.cases):
            want = parser.parse(case.output)
            for parts in _splits(case.output, _SEED + n):
                stream, reasoning, content = parser.stream(), "", ""
                for k, part in enumerate(parts):
                    r, c = stream.feed(part, final=k == len(parts) - 1)
                    reasoning, content = reasoning + r, content + c
                assert (reasoning, content) == want, f"{case.label or repr(case.output[:60])}, {_where(parts)}"
