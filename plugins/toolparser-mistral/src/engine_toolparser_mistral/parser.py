"""Mistral tool calls.

Two generations of the format, both after the ``[TOOL_CALLS]`` special token:

- v3 (Mistral 7B v0.3, Mixtral 8x22B, Nemo): a JSON array,
  ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``;
- v11+ (Mistral Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]f[ARGS]{...}``, the pair
  repeated for several calls.

Text before the first ``[TOOL_CALLS]`` is content. Mistral's template requires call ids of nine
letters and digits, so this parser makes them that way.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from engine.parsers import (
    PartialToolCall,
    ToolCall,
    ToolCallParse,
    ToolCallParser,
    default_tool_prompt,
    partial_tag_len,
    scan_call_array,
    scan_json_value,
    skip_ws,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolCallParser(ToolCallParser):
    # [TOOL_CALLS] is a special token: the detokenizer would remove it.
    needs_special_tokens = True

    def parse_partial(self, text: str, final: bool) -> ToolCallParse:
        at = text.find(TOOL_CALLS)
        if at < 0:
            # Trailing whitespace waits (always): it is dropped if [TOOL_CALLS] follows it.
            return ToolCallParse(text[:len(text) - (0 if final else partial_tag_len(text, TOOL_CALLS))].rstrip())
        result = ToolCallParse(text[:at].rstrip())
        i = skip_ws(text, at + len(TOOL_CALLS))
        if i >= len(text):
            return result
        if text[i] == "[" and not text.startswith(ARGS, i):
            calls, end, valid = scan_call_array(text, i, final, argument_keys=("arguments",))
            result.calls = calls
            if not valid and not calls:
                result.content += text[at:]
            return result
        while True:  # name[ARGS]{...}, repeated after [TOOL_CALLS]
            args_at = text.find(ARGS, i)
            if args_at < 0:
                if final:
                    result.content += text[i:]
                return result  # the name is still being written
            name = text[i:args_at].strip()
            j = skip_ws(text, args_at + len(ARGS))
            if j >= len(text):
                result.calls.append(PartialToolCall(name, "", final))
                return result
            arguments, end = scan_json_value(text, j, final)
            result.calls.append(PartialToolCall(name, arguments, final or end is not None))
            if end is None:
                return result
            i = skip_ws(text, end)
            if not text.startswith(TOOL_CALLS, i):
                return result  # the pairs ended; anything after them is dropped
            i += len(TOOL_CALLS)

    def render_calls(self, calls: list[ToolCall]) -> str:
        return TOOL_CALLS + json.dumps([{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls],
                                       ensure_ascii=False)

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        return default_tool_prompt(tools, TOOL_CALLS + '[{"name": "<function-name>", "arguments": {"<arg>": "<value>"}}]')

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
