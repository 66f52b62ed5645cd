"""Parsers of model output: tool calls (``--tool-call-parser``) and reasoning (``--reasoning-parser``).

Both are plugin kinds (hook API 4): the interfaces and the streaming machinery live here, the
formats in plugins (``plugins/toolparser-*``, ``plugins/reasoning-*``). See docs/tool_calling.md
and docs/reasoning.md.
"""

from engine.parsers.chat_output import ChatDelta, ChatOutput, ChatOutputParser
from engine.parsers.reasoning import ReasoningParser, ReasoningStream, ThinkTagReasoningParser
from engine.parsers.scan import MalformedJSON, partial_tag_len, scan_object, scan_value, skip_ws
from engine.parsers.stream import ParserStreamError
from engine.parsers.tool_calls import (
    PartialToolCall,
    ToolCall,
    ToolCallDelta,
    ToolCallParse,
    ToolCallParser,
    ToolCallStream,
    default_tool_prompt,
    scan_call_array,
    scan_call_object,
    scan_json_value,
)

__all__ = [
    "ChatDelta",
    "ChatOutput",
    "ChatOutputParser",
    "MalformedJSON",
    "ParserStreamError",
    "PartialToolCall",
    "ReasoningParser",
    "ReasoningStream",
    "ThinkTagReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParse",
    "ToolCallParser",
    "ToolCallStream",
    "default_tool_prompt",
    "partial_tag_len",
    "scan_call_array",
    "scan_call_object",
    "scan_json_value",
    "scan_object",
    "scan_value",
    "skip_ws",
]
