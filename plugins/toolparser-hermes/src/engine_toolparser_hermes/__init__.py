"""The ``hermes`` tool-call parser: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks (Hermes 2 Pro, Qwen2.5, Qwen3). Registration only; the parser is in ``parser.py``."""

from __future__ import annotations

from engine.hookspecs import ToolCallParserSpec, hookimpl


@hookimpl
def register_tool_call_parsers(register):  # type: ignore[no-untyped-def]
    register(ToolCallParserSpec(
        name="hermes", factory="engine_toolparser_hermes.parser:HermesToolCallParser",
        description="<tool_call>{json}</tool_call> blocks (Hermes, Qwen2.5, Qwen3)"))
