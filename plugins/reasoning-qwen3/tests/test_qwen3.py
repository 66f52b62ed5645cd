"""The qwen3 reasoning parser on recorded Qwen3 outputs (the conformance kit)."""

from __future__ import annotations

from engine.testing import ReasoningCase, ReasoningParserConformance


class TestQwen3(ReasoningParserConformance):
    parser_name = "qwen3"
    cases = (
        ReasoningCase("<think>\nOkay, the user asks for the capital of France. That is Paris.\n</think>\n\n"
                      "The capital of France is Paris.",
                      "Okay, the user asks for the capital of France. That is Paris.",
                      "The capital of France is Paris.", label="thinking"),
        ReasoningCase("The capital of France is Paris.", "", "The capital of France is Paris.",
                      label="enable_thinking false: no think block"),
        ReasoningCase("<think>\nThe user wants the weather; I should call get_weather.\n</think>\n\n<tool_call>\n"
                      '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                      "The user wants the weather; I should call get_weather.",
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                      label="thinking, then a tool call"),
        ReasoningCase("<think>\nLet me count: 1, 2, 3 <and> 4", "Let me count: 1, 2, 3 <and> 4", "",
                      label="cut off while thinking"),
    )
