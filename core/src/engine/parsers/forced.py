"""``tool_choice: required`` and a named ``tool_choice``: the output is constrained to a call.

As vLLM does, the request gets a JSON schema (the grammar backend enforces it) and the
constrained output is read back as calls, with no model-specific parser:

- ``required``: a JSON array of ``{"name": ..., "parameters": {...}}`` objects, each matching
  one tool (``anyOf``), at least one (exactly one when ``parallel_tool_calls`` is false);
- a named function: the output is that function's arguments object.
"""

from __future__ import annotations

import json
from typing import Any

from engine.parsers.scan import skip_ws
from engine.parsers.tool_calls import (
    PartialToolCall,
    ToolCall,
    ToolCallParse,
    ToolCallParser,
    default_tool_prompt,
    scan_call_array,
    scan_json_value,
)

#: what a tool without ``parameters`` takes (OpenAI: no arguments).
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of ``tool_choice: required`` output over ``tools`` (OpenAI tool dicts)."""
    one_of_each = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                       "parameters": parameters_of(t)},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of_each}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The schema of the output when ``tool_choice`` names ``tool``: its parameters."""
    return parameters_of(tool)


class RequiredCallsParser(ToolCallParser):
    """Reads the ``required`` schema's array; text that is not such an array is content."""

    def parse_partial(self, text: str, final: bool) -> ToolCallParse:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ToolCallParse(text if final else "")
        if text[i] != "[":
            return ToolCallParse(text)
        calls, _, valid = scan_call_array(text, i, final, argument_keys=("parameters",))
        if not calls and not valid:
            return ToolCallParse(text)
        return ToolCallParse("", calls)

    def render_calls(self, calls: list[ToolCall]) -> str:
        return json.dumps([{"name": c.name, "parameters": json.loads(c.arguments)} for c in calls],
                          ensure_ascii=False)

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        return default_tool_prompt(tools, '[{"name": "<function-name>", "parameters": {"<arg>": "<value>"}}]')


class NamedCallParser(ToolCallParser):
    """The whole output is the arguments of ``name``."""

    def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.name = name

    def parse_partial(self, text: str, final: bool) -> ToolCallParse:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ToolCallParse("", [PartialToolCall(self.name, "", final)])
        arguments, end = scan_json_value(text, i, final)
        return ToolCallParse("", [PartialToolCall(self.name, arguments, final or end is not None)])

    def render_calls(self, calls: list[ToolCall]) -> str:
        return calls[0].arguments

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        tool = next((t for t in tools if t["function"]["name"] == self.name), tools[0])
        return (default_tool_prompt([tool], '{"<arg>": "<value>"}')
                + f"\n\nCall the function {self.name} now: reply with its arguments object only.")
