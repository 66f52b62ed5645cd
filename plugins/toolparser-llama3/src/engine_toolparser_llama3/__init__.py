"""The ``llama3`` tool-call parser: Llama 3.1/3.2/3.3 JSON calls
(``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several joined by
``;``). Registration only; the parser is in ``parser.py``."""

from __future__ import annotations

from engine.hookspecs import ToolCallParserSpec, hookimpl


@hookimpl
def register_tool_call_parsers(register):  # type: ignore[no-untyped-def]
    register(ToolCallParserSpec(
        name="llama3", factory="engine_toolparser_llama3.parser:Llama3JsonToolCallParser",
        description='Llama 3.x JSON calls {"name": ..., "parameters": ...} (optionally after <|python_tag|>)'))
