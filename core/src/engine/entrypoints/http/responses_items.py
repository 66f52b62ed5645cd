"""``/v1/responses`` requests: the body's model, and its items as a chat completion's fields.

A Responses request is served as a chat completion: ``input`` items become chat messages
(``message`` items with text parts, ``function_call`` items as an assistant's ``tool_calls``,
``function_call_output`` items as ``tool`` messages; earlier ``reasoning`` items are dropped,
as chat templates drop earlier reasoning), ``tools`` (flat function tools) and ``tool_choice``
become the chat forms, ``text.format`` becomes ``response_format`` and ``reasoning.effort``
becomes ``reasoning_effort``. Bad input is a 400 naming the Responses field
(``input[2].type``, ``tools[0].name``, ``text.format.schema``).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.http.errors import APIError

if TYPE_CHECKING:
    from engine.entrypoints.http.context import ServingContext
    from engine.entrypoints.http.tool_calling import ToolPlan

#: Input item types served; the others (hosted tools' calls, item references) are a 400.
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
#: Fields accepted and ignored: bookkeeping and hosted features that change nothing here.
IGNORED_FIELDS = ("metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
                  "prompt_cache_retention", "prompt_cache_options", "context_management",
                  "stream_options", "include", "moderation", "background_options", "access_programs", "image")


class ResponsesRequest(BaseModel):
    """Every field of OpenAI's ``responses.create`` body (``ResponseCreateParams``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    background: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # -- not available here: a value other than null is a 400 (see check_unsupported) --
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # -- accepted and ignored (IGNORED_FIELDS) --
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream_options: dict[str, Any] | None = None
    include: list[str] | None = None
    moderation: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None

    def ignored_fields(self) -> list[str]:
        return [name for name in IGNORED_FIELDS if getattr(self, name) is not None]


def check_unsupported(req: ResponsesRequest) -> None:
    """400s for what this server cannot honour."""
    if req.input is None or req.input == []:
        raise APIError(400, "input: required: a string, or a list of at least one input item", param="input")
    if req.conversation is not None:
        raise APIError(400, "conversation: the Conversations API is not served here; continue a conversation "
                            "with previous_response_id", param="conversation")
    if req.prompt is not None:
        raise APIError(400, "prompt: stored prompt templates are not served here; send instructions and input",
                       param="prompt")
    if req.top_logprobs:
        raise APIError(400, "top_logprobs: log probabilities are not returned by /v1/responses here; use "
                            "/v1/chat/completions with logprobs", param="top_logprobs")
    if req.background and req.store is False:
        raise APIError(400, "background: a background response must be stored; leave store out or set it true",
                       param="background")
    if req.background and req.stream:
        raise APIError(400, "background: streaming a background response is not supported; poll "
                            "GET /v1/responses/{id} instead", param="background")


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat message dicts (``role``, ``content``, ``tool_calls``, ``tool_call_id``)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(400, f"{where}.role: invalid value {role!r}; accepted: {', '.join(_ROLES)}",
                               param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            arguments = _string(item, "arguments", where)
            try:
                json.loads(arguments or "{}")
            except ValueError:
                raise APIError(400, f"{where}.arguments: not valid JSON", param=f"{where}.arguments") from None
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the text and calls of one turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}.type: unknown or unsupported item type {kind!r}; accepted: "
                                f"{', '.join(ITEM_TYPES)}", param=f"{where}.type")
    return out


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as the items ``GET .../input_items`` lists: a string is a user message; every
    item gets an ``id`` when it has none (OpenAI's item types)."""
    from engine.entrypoints.http.responses_events import new_id

    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    out = []
    for item in value:
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            item["content"] = [{"type": "input_text", "text": item["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
        item.setdefault("id", new_id(prefix.get(item["type"], "item")))
        out.append(item)
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key}: required, a string", param=f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A string, or the text of a list of text parts (other parts are a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: expected a string or a list of input_text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise APIError(400, f"{where}[{j}].type: {kind!r} parts are not supported; accepted: "
                                "input_text, output_text", param=f"{where}[{j}].type")
    return "\n".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (``{"type": "function", "name", "parameters"}``) in the chat form."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(400, f"tools[{i}].type: {kind!r} tools are not supported (hosted tools run on "
                                "OpenAI's servers); accepted: function", param=f"tools[{i}].type")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice: invalid value {choice!r}; accepted: none, auto, required, "
                        '{"type": "function", "name": ...}', param="tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format`` (None for plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format: expected an object with a 'type'", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format.schema: required with type 'json_schema': a JSON Schema object",
                           param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise APIError(400, f"text.format.type: invalid value {kind!r}; accepted: text, json_object, json_schema",
                   param="text.format.type")


def reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    effort = (reasoning or {}).get("effort")
    accepted = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
    if effort is not None and effort not in accepted:
        raise APIError(400, f"reasoning.effort: invalid value {effort!r}; accepted: {', '.join(accepted)}",
                       param="reasoning.effort")
    return effort


# Chat names in errors raised by the shared chat machinery -> the Responses names.
_RENAMES = ((r"\bresponse_format\.json_schema\.schema\b", "text.format.schema"), (r"\bresponse_format\b", "text.format"),
            (r"\bmax_completion_tokens\b", "max_output_tokens"), (r"\bmessages\b", "input"),
            (r"\btools\[(\d+)\]\.function\.", r"tools[\1]."))


def renamed(exc: APIError) -> APIError:
    """``exc`` with the chat fields it names renamed to the Responses fields they came from."""
    message, param = exc.message, exc.param
    for pattern, name in _RENAMES:
        message = re.sub(pattern, name, message)
        param = re.sub(pattern, name, param) if param else param
    return APIError(exc.status, message, param=param, code=exc.code, type=exc.type)


async def render_prompt(ctx: ServingContext, messages: list[Any], kwargs: dict[str, Any] | None, plan: ToolPlan,
                        keep: int, truncate: bool, reserve: int) -> list[int]:
    """Token ids of ``messages`` under the chat template. With ``truncation: auto`` the oldest
    messages after the first ``keep`` (the instructions) are dropped, with tool results left
    without their call, until the prompt leaves ``reserve`` tokens of the context; the last
    message always stays (a prompt still too long is the usual 400)."""
    messages = list(messages)
    while True:
        droppable = truncate and len(messages) - keep > 1
        try:
            ids = await ctx.render_chat(messages, template_kwargs=kwargs, tools=plan)
        except APIError as exc:
            if not (droppable and exc.code == "context_length_exceeded"):
                raise
        else:
            if not (droppable and ctx.context_len - len(ids) < reserve):
                return ids
        del messages[keep]
        while len(messages) - keep > 1 and messages[keep].role == "tool":
            del messages[keep]
