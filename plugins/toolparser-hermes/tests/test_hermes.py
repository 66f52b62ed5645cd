"""The hermes parser on recorded Qwen2.5 / Qwen3 / Hermes outputs (the conformance kit), and
its handling of blocks that hold no call."""

from __future__ import annotations

from engine.testing import ToolCallCase, ToolCallParserConformance
from engine_toolparser_hermes.parser import HermesToolCallParser

WEATHER = {"location": "San Francisco, CA, USA"}


class TestHermes(ToolCallParserConformance):
    parser_name = "hermes"
    cases = (
        ToolCallCase(  # Qwen2.5-7B-Instruct, two parallel calls (Qwen's function-calling guide)
            '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": '
            '"San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>',
            calls=(("get_current_temperature", WEATHER),
                   ("get_temperature_date", {**WEATHER, "date": "2024-10-01"})),
            label="qwen2.5 parallel"),
        ToolCallCase(  # Qwen3 after its reasoning was split off: a sentence, then the call
            'I will look up the weather in Paris for you.\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "unit": "celsius", "days": 3}}\n</tool_call>',
            content="I will look up the weather in Paris for you.",
            calls=(("get_weather", {"city": "Paris", "unit": "celsius", "days": 3}),), label="qwen3 text + call"),
        ToolCallCase(  # Hermes 2 Pro: arguments before the name, nested values, escapes
            '<tool_call>\n{"arguments": {"query": "say \\"hi\\" </tool_call> {x}", "filters": {"tags": ["a", "b"], '
            '"limit": 10, "exact": false, "since": null}}, "name": "search"}\n</tool_call>',
            calls=(("search", {"query": 'say "hi" </tool_call> {x}',
                               "filters": {"tags": ["a", "b"], "limit": 10, "exact": False, "since": None}}),),
            label="hermes arguments first"),
        ToolCallCase(  # no arguments at all
            '<tool_call>\n{"name": "get_time"}\n</tool_call>', calls=(("get_time", {}),), label="no arguments"),
        ToolCallCase('Let me check.<tool_call>\n{"name": "lookup", "arguments": {"id": 7}}</tool_call> Done.',
                     content="Let me check. Done.", calls=(("lookup", {"id": 7}),), label="text around a block"),
    )


def test_a_block_without_a_call_object_stays_text() -> None:
    parser = HermesToolCallParser()
    text = "Here: <tool_call>not json</tool_call> and more"
    assert parser.parse(text) == (text, [])


def test_a_call_cut_off_by_the_token_limit_is_still_a_call() -> None:
    content, calls = HermesToolCallParser().parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    assert calls[0].arguments == '{"city": "Par'  # as OpenAI returns a truncated call


def test_stream_holds_back_a_partial_tag() -> None:
    stream = HermesToolCallParser().stream()
    assert stream.feed("Sure <tool_") == ("Sure", [])
    content, deltas = stream.feed('call>{"name": "f", "arguments": {"a": 1')
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("f", '{"a": 1')]
    content, deltas = stream.feed("}}</tool_call>", final=True)
    assert content == "" and [(d.id, d.arguments) for d in deltas] == [(None, "}")]
