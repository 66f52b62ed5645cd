"""The llama3 parser on recorded Llama 3.1 / 3.2 outputs (the conformance kit)."""

from __future__ import annotations

from engine.testing import ToolCallCase, ToolCallParserConformance
from engine_toolparser_llama3.parser import Llama3JsonToolCallParser


class TestLlama3(ToolCallParserConformance):
    parser_name = "llama3"
    cases = (
        ToolCallCase(  # Llama-3.1-8B-Instruct
            '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
            calls=(("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"}),),
            label="llama 3.1"),
        ToolCallCase(  # Llama-3.2-3B-Instruct adds "type"
            '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
            calls=(("get_weather", {"city": "Paris", "days": 2}),), label="llama 3.2"),
        ToolCallCase(  # with <|python_tag|> kept (skip_special_tokens false), two calls
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "format": "24h"}}',
            calls=(("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris", "format": "24h"})),
            label="python_tag, two calls"),
        ToolCallCase(  # nested arguments with brackets inside strings
            '  {"name": "run_query", "parameters": {"sql": "SELECT * FROM t WHERE a IN (1, 2) -- {x} [y]", '
            '"options": {"limit": 5, "explain": true}}}',
            calls=(("run_query", {"sql": "SELECT * FROM t WHERE a IN (1, 2) -- {x} [y]",
                                  "options": {"limit": 5, "explain": True}}),), label="nested"),
        ToolCallCase('{"answer": 42, "unit": "none"}', content='{"answer": 42, "unit": "none"}',
                     label="a JSON object that is not a call"),
    )


def test_text_before_json_is_text() -> None:
    text = 'Here you go: {"name": "f", "parameters": {}}'
    assert Llama3JsonToolCallParser().parse(text) == (text, [])
