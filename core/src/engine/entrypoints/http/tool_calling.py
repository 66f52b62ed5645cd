"""Tools and reasoning in chat completions: request checks, prompt rendering, reading the output.

- ``plan_tools`` validates ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (a 400 naming
  the field for bad input) into a ``ToolPlan``.
- ``template_messages`` turns the request's messages into the dicts chat templates expect,
  assistant ``tool_calls`` and ``tool`` messages included; for a template that ignores
  ``tools`` it writes the tool descriptions into the system prompt and earlier calls into the
  assistant text, in the format the output will be read in.
- ``ToolPlan.sampling`` adds what the request needs to the sampling params: the JSON schema of a
  forced ``tool_choice`` (``required`` or a named function; the grammar backend enforces it), and
  ``skip_special_tokens: false`` for parsers whose markup is a special token.
- ``output_parser`` is the reader of the output: the reasoning parser (``--reasoning-parser``),
  then the tool calls (``--tool-call-parser`` for ``auto``; the forced formats otherwise).

Without ``--tool-call-parser`` a request with tools and ``tool_choice: auto`` is served as SGLang
does without a parser: the tools reach the prompt and the output is returned as text. With a
parser, tools the model may call and a grammar (``response_format`` etc.) are refused together
(``ToolPlan.sampling``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.entrypoints.http.errors import APIError
from engine.parsers import ChatDelta, ChatOutputParser, ReasoningParser, ToolCall, ToolCallParser
from engine.parsers.forced import NamedCallParser, RequiredCallsParser, named_schema, required_schema
from engine.sampling.sampling_params import SamplingParams

# The sampling params that put a request's output under a grammar.
GRAMMAR_FIELDS = SamplingParams.GRAMMAR_FIELDS

if TYPE_CHECKING:
    from engine.entrypoints.http.protocol import ChatCompletionRequest


class ServerParsers(Protocol):
    """The parsers the server was started with: what this module reads of the serving context
    (``engine.entrypoints.http.context.ServingContext``, which imports this module)."""

    tool_parser: ToolCallParser | None
    reasoning_parser: ReasoningParser | None

TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolPlan:
    """What a request asks of tools, validated."""

    #: the request's tools (OpenAI ``{"type": "function", "function": {...}}`` dicts).
    tools: list[dict[str, Any]] = field(default_factory=list)
    #: "none", "auto", "required" or "named".
    mode: str = "none"
    #: the function a named ``tool_choice`` forces.
    named: str | None = None
    #: more than one call allowed (``parallel_tool_calls``, default true).
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def forced_parser(self) -> ToolCallParser | None:
        if self.mode == "required":
            return RequiredCallsParser()
        if self.mode == "named":
            assert self.named is not None
            return NamedCallParser(self.named)
        return None

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow (forced modes only)."""
        if self.mode == "required":
            return required_schema(self.tools, self.parallel)
        if self.mode == "named":
            return named_schema(next(t for t in self.tools if t["function"]["name"] == self.named))
        return None

    def sampling(self, params: dict[str, Any], parser: ToolCallParser | None) -> dict[str, Any]:
        """``params`` with the forced schema (as ``json_schema``) and the parser's token needs.

        A grammar (``response_format``, or the ``regex``/``ebnf``/``json_schema``/``structural_tag``
        extensions) together with tools the model may call is a 400: a forced ``tool_choice``
        is a grammar of its own, and ``auto`` with a tool-call parser reads calls from free-text
        markup that the grammar never lets the model write (its calls would be lost silently).
        """
        taken = [k for k in GRAMMAR_FIELDS if params.get(k) is not None]
        grammar = "response_format" if taken and taken[0] in ("json_schema", "structural_tag") else (
            taken[0] if taken else "")
        schema = self.schema()
        if schema is not None:
            if taken:
                raise APIError(400, f"tool_choice: '{self.named or self.mode}' constrains the output to a tool "
                                    f"call and cannot be combined with {grammar}", param="tool_choice")
            params["json_schema"] = json.dumps(schema)
        elif self.mode == "auto" and parser is not None:
            if taken:
                raise APIError(400, f"tool_choice: 'auto' (the default with tools) reads tool calls from the model's "
                                    f"free text, which {grammar} constrains to its grammar, so no call could be "
                                    f"made; send tool_choice 'none' to keep the tools in the prompt and answer in "
                                    f"the format, or leave out {grammar}", param="tool_choice")
            if parser.needs_special_tokens:
                params["skip_special_tokens"] = False
        return params


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    """Validates the request's tool fields; bad input is a 400 naming the field."""
    tools = [_check_tool(t, i) for i, t in enumerate(req.tools or [])]
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(400, f"tools[{i}].function.name: '{name}' is given twice; function names must be unique",
                           param=f"tools[{i}].function.name")
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        return ToolPlan(tools, "auto" if tools else "none", None, parallel)
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise APIError(400, f"tool_choice: invalid value '{choice}'; accepted: none, auto, required, "
                                '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice: 'required' needs tools; the request has none", param="tool_choice")
        return ToolPlan(tools, choice if tools else "none", None, parallel)
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, 'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
                       param="tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice: function '{name}' is not among the request's tools "
                            f"({', '.join(names) or 'none given'})", param="tool_choice")
    return ToolPlan(tools, "named", name, parallel)


def _check_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise APIError(400, f"{where}: expected an object", param=where)
    if tool.get("type", "function") != "function":
        raise APIError(400, f"{where}.type: invalid value {tool.get('type')!r}; accepted: 'function'",
                       param=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(400, f"{where}.function: required, an object with name, description and parameters",
                       param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise APIError(400, f"{where}.function.name: required, a non-empty string", param=f"{where}.function.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(400, f"{where}.function.parameters: expected a JSON Schema object",
                       param=f"{where}.function.parameters")
    return {"type": "function", "function": function}


def _template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else json.dumps(template)


def template_messages(conversation: list[dict[str, Any]], plan: ToolPlan, tokenizer: Any,
                      parser: ToolCallParser | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages for the template, extra template kwargs).

    A template that reads ``tools`` gets them as ``tools=`` (transformers passes it to the
    template); one that does not gets their description in the system prompt, written by the
    parser the output will be read with. Likewise assistant ``tool_calls`` go to a template
    that reads them as dicts (arguments decoded), else into the message text.
    """
    source = _template_source(tokenizer)
    writer = plan.forced_parser() or parser or RequiredCallsParser()
    if "tool_calls" not in source:
        conversation = [_calls_as_text(m, writer) for m in conversation]
    if not plan.tools or plan.mode == "none" and "tools" not in source:
        return conversation, {}
    if "tools" in source:
        return conversation, {"tools": plan.tools}
    prompt = writer.tool_prompt(plan.tools)
    if conversation and conversation[0]["role"] in ("system", "developer"):
        first = dict(conversation[0], content=f"{conversation[0]['content']}\n\n{prompt}".lstrip())
        return [first, *conversation[1:]], {}
    return [{"role": "system", "content": prompt}, *conversation], {}


def _calls_as_text(message: dict[str, Any], writer: ToolCallParser) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = writer.render_calls([ToolCall(c["function"]["name"], json.dumps(c["function"]["arguments"]))
                                for c in calls])
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = f"{out.get('content') or ''}\n{text}".lstrip("\n")
    return out


def output_parser(ctx: ServerParsers, plan: ToolPlan, params: dict[str, Any]) -> ChatOutputParser | None:
    """The reader of this request's output (``params``: its sampling params); None when the
    output is plain text."""
    max_calls = None if plan.parallel else 1
    if plan.forced:
        # Constrained from the first token: there is no reasoning to split off.
        return ChatOutputParser(None, plan.forced_parser(), max_calls)
    # Output under a grammar (response_format) is constrained from its first token too: no
    # reasoning, and no markup a tool parser could find.
    constrained = any(params.get(k) is not None for k in GRAMMAR_FIELDS)
    tools = ctx.tool_parser if plan.mode == "auto" and not constrained else None
    reasoning = None if constrained else ctx.reasoning_parser
    if tools is None and reasoning is None:
        return None
    return ChatOutputParser(reasoning, tools, max_calls)


def message(parser: ChatOutputParser | None, text: str, with_reasoning: bool) -> tuple[dict[str, Any], bool]:
    """The response's ``message`` for the output ``text``, and whether it holds tool calls."""
    if parser is None:
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if with_reasoning:
            msg["reasoning_content"] = None
        return msg, False
    output = parser.parse(text)
    content = output.content if output.content.strip() or not output.calls else None
    msg = {"role": "assistant", "content": content}
    if with_reasoning:
        msg["reasoning_content"] = output.reasoning
    if output.calls:
        new_id = parser.tools.new_call_id if parser.tools is not None else ToolCallParser().new_call_id
        msg["tool_calls"] = [{"id": new_id(), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in output.calls]
    return msg, bool(output.calls)


def finish_reason(reason: str | None, plan: ToolPlan, called: bool) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` when the model stopped after calling (a named
    ``tool_choice`` finishes with ``stop``, as OpenAI's does)."""
    if reason == "stop" and called and plan.mode != "named":
        return "tool_calls"
    return reason


def delta_dict(delta: ChatDelta, with_reasoning: bool) -> dict[str, Any]:
    """A streamed chunk's ``delta``."""
    out: dict[str, Any] = {}
    if delta.reasoning and with_reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.calls:
        out["tool_calls"] = [d.to_dict() for d in delta.calls]
    return out
