"""Llama 3.x JSON tool calls.

Llama 3.1+ answers a tool request with the call as the whole message:
``{"name": "f", "parameters": {...}}`` (``"arguments"`` is accepted too), optionally preceded
by the ``<|python_tag|>`` token, several calls separated by ``;``. An output that does not start
with ``{`` (after the tag and whitespace) is normal text; so is a leading JSON object that is
not a call (no string ``name``).
"""

from __future__ import annotations

import json
from typing import Any

from engine.parsers import ToolCall, ToolCallParse, ToolCallParser, default_tool_prompt, scan_call_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolCallParser(ToolCallParser):
    def parse_partial(self, text: str, final: bool) -> ToolCallParse:
        i = skip_ws(text, 0)
        head = text[i:]
        if head.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(head):
            return ToolCallParse("")  # empty so far, or the tag being written
        if i >= len(text):
            return ToolCallParse(text if final else "")
        if text[i] != "{":
            return ToolCallParse(text)
        result = ToolCallParse("")
        while True:
            call, end = scan_call_object(text, i, final)
            if call is None:  # not a call: the first object makes it all text, a later one is text
                result.content = text[i:] if result.calls else text
                return result
            if call.name is None and not call.complete:
                return result  # unnamed so far: hold back
            result.calls.append(call)
            if end is None:
                return result
            j = skip_ws(text, end)
            if j >= len(text):
                return result
            if text[j] != ";":
                result.content = text[j:]
                return result
            i = skip_ws(text, j + 1)
            if i >= len(text):
                return result
            if text[i] != "{":
                result.content = text[i:]
                return result

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": json.loads(c.arguments)}, ensure_ascii=False)
                         for c in calls)

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        return default_tool_prompt(tools, '{"name": "<function-name>", "parameters": {"<arg>": "<value>"}}')
