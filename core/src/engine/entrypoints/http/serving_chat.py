"""``POST /v1/chat/completions``: chat templates, n choices, logprobs, SSE streaming."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response

from engine.entrypoints.http.disaggregation import bootstrap_fields
from engine.entrypoints.http.errors import APIError, parse_body
from engine.entrypoints.http.generation import (
    SSE_DONE,
    Choice,
    ChunkSSE,
    aborted_error,
    finish_reason,
    log_stream_failure,
    make_choices,
    matched_stop,
    response_model,
    run_to_completion,
    sse_error,
    sse_response,
    stream_finish_reason,
    stream_outputs,
    usage,
)
from engine.entrypoints.http.logprobs import chat_logprobs
from engine.entrypoints.http.protocol import ChatCompletionRequest
from engine.entrypoints.http.sampling import (
    RENAMES,
    check_common,
    check_max_tokens,
    grammar_renames,
    guided_renames,
    sampling_params,
    stream_usage_wanted,
)
from engine.entrypoints.http.tool_calling import (
    ToolPlan,
    delta_dict,
    message,
    output_parser,
    plan_tools,
)
from engine.entrypoints.http.tool_calling import finish_reason as tool_finish_reason
from engine.managers.tokenizer_manager import GenerateRequest

if TYPE_CHECKING:
    from starlette.requests import Request

    from engine.entrypoints.http.context import ServingContext
    from engine.parsers import ChatOutputParser

logger = logging.getLogger(__name__)

# The prompt is built from messages; the engine's names for it mean "messages" here.
_RENAMES = {**RENAMES, "input_ids": "messages", "text": "messages"}


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    req = parse_body(await request.body(), ChatCompletionRequest)
    lora = ctx.resolve_model(req.model)
    _check_supported(req)
    ctx.check_accepting()
    plan = plan_tools(req)
    mm_items: list[Any] = []  # images and video of the messages' content parts
    prompt_ids = await ctx.render_chat(req.messages, template_kwargs=template_kwargs(ctx, req), tools=plan,
                                       mm_items=mm_items)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = max(ctx.context_len - len(prompt_ids), 1)  # OpenAI: until the context is full
    elif max_tokens < 1:
        raise APIError(400, f"{max_param}: must be at least 1", param=max_param)
    else:
        check_max_tokens(max_tokens, len(prompt_ids), ctx.context_len, max_param)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    base = GenerateRequest(
        input_ids=prompt_ids, sampling_params=plan.sampling(sampling_params(req, max_tokens), ctx.tool_parser),
        rid=req.rid or response_id,
        return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0, priority=req.priority or 0,
        mm_items=mm_items,
        lora_path=lora, **bootstrap_fields(ctx, req)[0])
    # A forced tool_choice is a JSON schema made from the tools: its errors are the tools'.
    forced = {"json_schema": "tools"} if plan.forced else {**grammar_renames(req.response_format),
                                                            **guided_renames(req)}
    choices = await make_choices(ctx, [base], req.n, renames={**_RENAMES, "max_new_tokens": max_param, **forced})
    reader = output_parser(ctx, plan, base.sampling_params)
    created = int(time.time())
    if req.stream:
        return sse_response(ctx, choices, _stream(ctx, req, choices, response_id, created, plan, reader))
    outputs = await run_to_completion(ctx, choices, request)
    by_index = {c.index: out for c, out in zip(choices, outputs, strict=True)}
    body_choices = []
    for choice, out in zip(choices, outputs, strict=True):
        meta = out["meta_info"]
        msg, called = message(reader, out["text"], ctx.reasoning_parser is not None)
        entry: dict[str, Any] = {
            "index": choice.index,
            "message": msg,
            "logprobs": _logprobs(ctx, req, meta, 0),
            "finish_reason": tool_finish_reason(finish_reason(meta), plan, called),
            "matched_stop": matched_stop(meta),
        }
        body_choices.append(entry)
    return JSONResponse({
        "id": response_id, "object": "chat.completion", "created": created,
        "model": response_model(ctx, req.model, lora),
        "choices": body_choices, "usage": usage(choices, by_index), "system_fingerprint": None,
    })


def _check_supported(req: ChatCompletionRequest) -> None:
    check_common(req)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    if req.modalities is not None and "audio" in req.modalities:
        raise APIError(400, "modalities: 'audio' output is not supported; accepted: [\"text\"]", param="modalities")
    if req.audio is not None:
        raise APIError(400, "audio: audio output is not supported; omit it", param="audio")
    _functions_as_tools(req)


def _functions_as_tools(req: ChatCompletionRequest) -> None:
    """The deprecated ``functions`` / ``function_call`` as ``tools`` / ``tool_choice``."""
    if req.functions is None and req.function_call is None:
        return
    if req.tools is not None or req.tool_choice is not None:
        raise APIError(400, "functions: cannot be combined with tools or tool_choice; send tools (functions is "
                            "its deprecated form)", param="functions")
    if req.functions is not None:
        req.tools = [{"type": "function", "function": f} for f in req.functions]
    call = req.function_call
    if isinstance(call, dict):
        if not isinstance(call.get("name"), str):
            raise APIError(400, 'function_call: expected "none", "auto" or {"name": ...}', param="function_call")
        req.tool_choice = {"type": "function", "function": {"name": call["name"]}}
    elif call is not None:
        if call not in ("none", "auto"):
            raise APIError(400, f"function_call: invalid value {call!r}; accepted: none, auto, "
                                '{"name": ...}', param="function_call")
        req.tool_choice = call


def template_kwargs(ctx: ServingContext, req: Any) -> dict[str, Any] | None:
    """``chat_template_kwargs``, with ``reasoning_effort: none`` as ``enable_thinking: false`` on a
    server with a reasoning parser (the switch Qwen3-style templates read)."""
    kwargs = req.chat_template_kwargs
    if req.reasoning_effort == "none" and ctx.reasoning_parser is not None:
        kwargs = {"enable_thinking": False, **(kwargs or {})}
    return kwargs


def first_call_deltas(delta: dict[str, Any]) -> list[dict[str, Any]]:
    """``delta`` as OpenAI streams a new tool call: the delta that names it carries empty
    arguments, its argument text follows in a delta of its own (clients that append every
    delta's arguments to the first one's would otherwise read the first piece twice)."""
    calls = delta.get("tool_calls")
    if not calls or not any("id" in c and c["function"]["arguments"] for c in calls):
        return [delta]
    named = [{**c, "function": {**c["function"], "arguments": ""}} if "id" in c else c for c in calls]
    rest = [{"index": c["index"], "function": {"arguments": c["function"]["arguments"]}}
            for c in calls if "id" in c and c["function"]["arguments"]]
    return [{**delta, "tool_calls": named}, {"tool_calls": rest}]


def _logprobs(ctx: ServingContext, req: ChatCompletionRequest, meta: dict[str, Any], start: int) -> dict[str, Any] | None:
    if not req.logprobs:
        return None
    entries = (meta.get("output_token_logprobs") or [])[start:]
    tops = (meta.get("output_top_logprobs") or [])[start:]
    return chat_logprobs(entries, tops, ctx.token_text, req.top_logprobs or 0)


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, choices: list[Choice],
                  response_id: str, created: int, plan: ToolPlan, reader: ChatOutputParser | None) -> AsyncIterator[bytes]:
    with_usage = stream_usage_wanted(req)
    # Per choice: the output read as it streams (reasoning, content, tool-call deltas).
    readers = {c.index: reader.stream() for c in choices} if reader is not None else {}
    with_reasoning = ctx.reasoning_parser is not None
    model = response_model(ctx, req.model, choices[0].request.lora_path)

    encode_chunk = ChunkSSE({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model})

    def chunk(parts: list[dict[str, Any]], usage_block: dict[str, Any] | None = None) -> bytes:
        data: dict[str, Any] = {"choices": parts}
        if with_usage:
            data["usage"] = usage_block  # null on every chunk but the last, as OpenAI does
        return encode_chunk(data)

    for choice in choices:
        yield chunk([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
    sent_chars = {c.index: 0 for c in choices}
    sent_logprobs = {c.index: 0 for c in choices}
    finals: dict[int, dict[str, Any]] = {}
    aborted: list[dict[str, Any]] = []
    try:
        async for choice, out in stream_outputs(ctx, choices):
            i = choice.index
            meta = out["meta_info"]
            reason = stream_finish_reason(meta)  # "abort" ends this choice; the others run on
            if reason == "abort":
                aborted.append(meta)
            text = out["text"][sent_chars[i]:]
            sent_chars[i] = len(out["text"])
            if i in readers:
                delta = delta_dict(readers[i].feed(text, final=reason is not None), with_reasoning)
                reason = tool_finish_reason(reason, plan, readers[i].called)
            else:
                delta = {"content": text} if text else {}
            logprobs = _logprobs(ctx, req, meta, sent_logprobs[i])
            sent_logprobs[i] = len(meta.get("output_token_logprobs") or [])
            if logprobs is not None and not logprobs["content"]:
                logprobs = None
            if not delta and logprobs is None and reason is None:
                continue  # the detokenizer held back a partial character
            *before, delta = first_call_deltas(delta)
            for early in before:
                yield chunk([{"index": i, "delta": early, "logprobs": None, "finish_reason": None}])
            part: dict[str, Any] = {"index": i, "delta": delta,
                                    "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                part["matched_stop"] = matched_stop(meta)
                finals[i] = out
            yield chunk([part])
        if with_usage:
            yield chunk([], usage(choices, finals))
        if aborted:
            yield sse_error(aborted_error(aborted))
    except Exception as exc:
        log_stream_failure(f"chat stream {response_id}", exc)
        yield sse_error(exc)
    yield SSE_DONE
