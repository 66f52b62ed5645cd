"""The ``mistral`` tool-call parser: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``
(and the newer ``[TOOL_CALLS]name[ARGS]{...}``). Registration only; the parser is in ``parser.py``."""

from __future__ import annotations

from engine.hookspecs import ToolCallParserSpec, hookimpl


@hookimpl
def register_tool_call_parsers(register):  # type: ignore[no-untyped-def]
    register(ToolCallParserSpec(
        name="mistral", factory="engine_toolparser_mistral.parser:MistralToolCallParser",
        description="[TOOL_CALLS] followed by a JSON array of calls, or name[ARGS]{...} (Mistral)"))
