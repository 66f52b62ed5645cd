"""The streaming machinery, the call-object scanner and the forced tool_choice formats."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.parsers import ParserStreamError, PartialToolCall, ToolCall, ToolCallParse, ToolCallParser
from engine.parsers.forced import NamedCallParser, RequiredCallsParser, named_schema, required_schema
from engine.parsers.tool_calls import scan_call_object
from engine.testing.conformance.parsers import ToolCallParserConformance

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def test_call_object_name_after_arguments_and_string_arguments() -> None:
    call, end = scan_call_object('{"arguments": {"a": 1}, "name": "f"}', 0, final=False)
    assert call == PartialToolCall("f", '{"a": 1}', True) and end is not None
    call, _ = scan_call_object('{"name": "f", "arguments": "{\\"a\\": 1}"}', 0, final=False)
    assert call is not None and json.loads(call.arguments) == {"a": 1}
    pending, _ = scan_call_object('{"arguments": {"a": 1}', 0, final=False)
    assert pending == PartialToolCall(None, '{"a": 1}', False)
    assert scan_call_object('{"answer": 42}', 0, final=False)[0] is None  # no name: not a call


def test_required_schema_accepts_calls_and_rejects_others() -> None:
    schema = required_schema(TOOLS, parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = required_schema(TOOLS, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, one)
    assert named_schema(TOOLS[1]) == {"type": "object", "properties": {}}


def test_forced_parsers_read_their_output() -> None:
    out = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    assert RequiredCallsParser().parse(out) == ("", [ToolCall("get_weather", '{"city": "Paris"}'),
                                                     ToolCall("get_time", "{}")])
    assert NamedCallParser("get_weather").parse(' {"city": "Rome"} ') == ("", [ToolCall("get_weather", '{"city": "Rome"}')])


class TestRequiredFormat(ToolCallParserConformance):
    """The kit on the required-format reader (it is a parser like the plugins' ones)."""

    parser_name = "required"
    cases = ()
    plain_texts = ("",)

    def _parser(self) -> ToolCallParser:
        return RequiredCallsParser()

    def test_has_cases(self) -> None:
        pass  # not a registered plugin

    def test_streams_like_it_parses_at_every_boundary(self) -> None:
        from engine.testing.conformance.parsers import ToolCallCase

        type(self).cases = (ToolCallCase(
            '[{"name": "get_weather", "parameters": {"city": "Par\\"is"}}, {"name": "get_time", "parameters": {}}]',
            calls=(("get_weather", {"city": 'Par"is'}), ("get_time", {}))),)
        super().test_parses_recorded_outputs()
        super().test_streams_like_it_parses_at_every_boundary()


class _TakesBack(ToolCallParser):
    """Sends a partial tag as content, then takes it back: what the kit must catch."""

    def parse_partial(self, text: str, final: bool) -> ToolCallParse:
        at = text.find("<c>")
        if at < 0:
            return ToolCallParse(text)
        return ToolCallParse(text[:at], [PartialToolCall("f", text[at + 3:], final)])

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "".join(f"<c>{c.arguments}" for c in calls)


def test_a_parser_that_takes_text_back_fails_the_stream() -> None:
    stream = _TakesBack().stream()
    stream.feed("hi <")
    with pytest.raises(ParserStreamError, match="changed content"):
        stream.feed('c>{"a": 1}')


def test_the_kit_fails_a_parser_that_takes_text_back() -> None:
    from engine.testing.conformance.parsers import ToolCallCase

    class Kit(ToolCallParserConformance):
        cases = (ToolCallCase('hi <c>{"a": 1}', content="hi ", calls=(("f", {"a": 1}),)),)

        def _parser(self) -> ToolCallParser:
            return _TakesBack()

    Kit().test_parses_recorded_outputs()  # whole outputs are right...
    with pytest.raises(ParserStreamError):
        Kit().test_streams_like_it_parses_at_every_boundary()  # ...streaming is not
