"""The mistral parser on recorded Mistral outputs of both format generations (the conformance kit)."""

from __future__ import annotations

from engine.testing import ToolCallCase, ToolCallParserConformance
from engine_toolparser_mistral.parser import MistralToolCallParser


class TestMistral(ToolCallParserConformance):
    parser_name = "mistral"
    cases = (
        ToolCallCase(  # Mistral-7B-Instruct-v0.3
            '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
            calls=(("get_current_weather", {"location": "Paris, France", "format": "celsius"}),), label="v3 array"),
        ToolCallCase(  # Mistral-Nemo, two calls, text first
            'Let me check both.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_weather", "arguments": {"city": "Lyon, \\"FR\\""}}]',
            content="Let me check both.",
            calls=(("get_weather", {"city": "Paris"}), ("get_weather", {"city": 'Lyon, "FR"'})), label="v3 two calls"),
        ToolCallCase(  # Mistral-Small-3.2: name[ARGS]{...}
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}',
            calls=(("get_weather", {"city": "Paris", "days": [1, 2]}),), label="v11"),
        ToolCallCase(
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
            calls=(("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})), label="v11 two calls"),
    )


def test_call_ids_are_nine_alphanumerics() -> None:
    ident = MistralToolCallParser().new_call_id()
    assert len(ident) == 9 and ident.isalnum()
