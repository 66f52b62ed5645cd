"""Hermes-format tool calls: any number of ``<tool_call>`` blocks, each holding one JSON object
``{"name": ..., "arguments": {...}}``, with normal text around them."""

from __future__ import annotations

import json
from typing import Any

from engine.parsers import ToolCall, ToolCallParse, ToolCallParser, partial_tag_len, scan_call_object, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolCallParser(ToolCallParser):
    def parse_partial(self, text: str, final: bool) -> ToolCallParse:
        content: list[str] = []
        result = ToolCallParse("")
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail[:len(tail) - (0 if final else partial_tag_len(tail, START))])
                break
            content.append(text[pos:start])
            body = skip_ws(text, start + len(START))
            if body >= len(text):
                if final:
                    content.append(text[start:])
                break  # the block has only begun
            call, end = (scan_call_object(text, body, final) if text[body] == "{" else (None, None))
            if call is None:
                # Not a call: the block is text. Hold it back until it is whole.
                close = text.find(END, body)
                if close < 0:
                    if final:
                        content.append(text[start:])
                    break
                content.append(text[start:close + len(END)])
                pos = close + len(END)
                continue
            if call.name is None and not call.complete:
                break  # unnamed so far: hold back
            result.calls.append(call)
            if end is None:
                break
            close = text.find(END, end)
            if close < 0:
                break  # whatever stands between the object and the closing tag is dropped
            pos = close + len(END)
        # Whitespace between blocks is not content: hold trailing whitespace back, always.
        result.content = "".join(content).rstrip()
        return result

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"{START}\n{json.dumps({'name': c.name, 'arguments': json.loads(c.arguments)}, ensure_ascii=False)}\n{END}"
                         for c in calls)

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to help with the user's request. "
                f"The functions you can call are described inside <tools></tools>:\n<tools>\n{signatures}\n</tools>\n\n"
                "To call a function, write a JSON object with its name and arguments inside "
                f"{START}{END} tags:\n{START}\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n{END}")
