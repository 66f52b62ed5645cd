"""OpenAI's Responses API: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``, cancel.

A request is served as a chat completion (``responses_items`` maps its fields), always
generated as a stream and read by the chat route's output parser; ``ResponseWriter`` turns
what each piece adds into output items and the documented events. Non-streamed requests
return the writer's final response; ``stream: true`` sends its events as SSE; ``background:
true`` returns at once and runs the generation as a task that cancel aborts. Stored responses
(``store``, default true) live in ``ResponseStore``; ``previous_response_id`` continues the
stored conversation (its input and output, not its instructions).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from engine.entrypoints.http.errors import (
    APIError,
    engine_dead_error,
    from_request_error,
    from_validation_error,
    parse_body,
    shutting_down_error,
)
from engine.entrypoints.http.generation import (
    Choice,
    aborted_error,
    log_stream_failure,
    make_choices,
    response_model,
    sse_response,
    stream_finish_reason,
    stream_outputs,
)
from engine.entrypoints.http.protocol import ChatCompletionRequest
from engine.entrypoints.http.responses_events import ResponseWriter, conversation_of, new_id
from engine.entrypoints.http.responses_items import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    check_unsupported,
    input_items,
    input_messages,
    reasoning_effort,
    renamed,
    render_prompt,
    response_format,
)
from engine.entrypoints.http.responses_store import ResponseStore, StoredResponse, store_of
from engine.entrypoints.http.responses_stored import router as stored_router
from engine.entrypoints.http.sampling import (
    RENAMES,
    check_max_tokens,
    grammar_renames,
    sampling_params,
)
from engine.entrypoints.http.serving_chat import template_kwargs
from engine.entrypoints.http.tool_calling import ToolPlan, output_parser, plan_tools
from engine.managers.tokenizer_manager import (
    EngineDeadError,
    GenerateRequest,
    RequestError,
    ServerShuttingDownError,
)
from engine.parsers import ChatDelta, ChatOutputParser

if TYPE_CHECKING:
    from engine.entrypoints.http.context import ServingContext

logger = logging.getLogger(__name__)
router = APIRouter()
router.include_router(stored_router)  # GET, DELETE, input_items, cancel


@dataclass
class Run:
    """One response being generated."""

    writer: ResponseWriter
    choices: list[Choice]
    reader: ChatOutputParser | None
    #: the conversation so far (without the instructions), stored for follow-ups.
    conversation: list[dict[str, Any]]
    #: this request's input items (``GET .../input_items``).
    input_items: list[dict[str, Any]]
    #: where it is kept when the request asks to be stored (``store``), else None.
    store: ResponseStore | None
    #: a background response's entry (stored from the start).
    entry: StoredResponse | None = None
    #: what ended the generation early (the response then has status "failed").
    failure: APIError | None = None


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    """OpenAI Responses: ``input`` items in, output items (messages, function calls, reasoning) out."""
    ctx: ServingContext = request.app.state.ctx
    req = parse_body(await request.body(), ResponsesRequest)
    ctx.resolve_model(req.model)  # a 404 before the input is read
    check_unsupported(req)
    if req.ignored_fields():
        logger.debug("responses fields accepted and ignored: %s", ", ".join(req.ignored_fields()))
    ctx.check_accepting()
    store = store_of(request.app.state)
    try:
        run = await _prepare(ctx, req, store)
    except APIError as exc:
        raise renamed(exc) from None
    if req.stream:
        return sse_response(ctx, run.choices, _sse(ctx, run))
    if req.background:
        run.entry = StoredResponse(run.writer.response, rid=run.choices[0].request.rid, input_items=run.input_items)
        run.writer.response["status"] = "queued"
        run.entry.task = asyncio.ensure_future(_background(ctx, run))
        store.put(run.entry)
        return JSONResponse(run.writer.response)
    task = asyncio.ensure_future(_run(ctx, run))
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()  # the client went away: closing the stream aborts the request
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise APIError(400, "the client disconnected; the request was aborted", code="request_aborted")
    if run.failure is not None:
        raise run.failure
    return JSONResponse(task.result())


async def _prepare(ctx: ServingContext, req: ResponsesRequest, store: ResponseStore) -> Run:
    conversation: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise APIError(404, f"previous_response_id: response '{req.previous_response_id}' not found (never "
                                "stored, deleted, or evicted from the store of the last "
                                f"{store.capacity} responses)", param="previous_response_id",
                           code="previous_response_not_found")
        if previous.running:
            raise APIError(400, f"previous_response_id: response '{req.previous_response_id}' is still "
                                f"{previous.response['status']}", param="previous_response_id")
        conversation = list(previous.conversation)
    assert req.input is not None  # check_unsupported
    conversation += input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if not system + conversation:
        raise APIError(400, "input: holds no message for the model (reasoning items alone are left out of "
                            "the prompt)", param="input")
    try:
        chat = ChatCompletionRequest.model_validate({
            "messages": system + conversation, "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "response_format": response_format(req.text), "reasoning_effort": reasoning_effort(req.reasoning),
        })
    except ValidationError as exc:  # the items were checked above; this names what slipped through
        raise from_validation_error(exc, ChatCompletionRequest) from None
    plan = plan_tools(chat)
    prompt_ids = await render_prompt(ctx, chat.messages, template_kwargs(ctx, chat), plan, len(system),
                                     req.truncation == "auto", req.max_output_tokens or 1)
    max_tokens = req.max_output_tokens
    if max_tokens is None:
        max_tokens = max(ctx.context_len - len(prompt_ids), 1)
    else:
        check_max_tokens(max_tokens, len(prompt_ids), ctx.context_len, "max_output_tokens")
    response_id = new_id("resp")
    lora = ctx.resolve_model(req.model)  # checked on arrival; resolved again, it may have been unloaded since
    base = GenerateRequest(input_ids=prompt_ids, sampling_params=plan.sampling(sampling_params(chat, max_tokens),
                                                                              ctx.tool_parser), rid=response_id,
                           lora_path=lora)
    renames = {**RENAMES, "input_ids": "input", "text": "input", "max_new_tokens": "max_output_tokens",
               **({"json_schema": "tools"} if plan.forced else grammar_renames(chat.response_format))}
    choices = await make_choices(ctx, [base], 1, renames=renames)
    reader = output_parser(ctx, plan, base.sampling_params)
    if reader is not None and req.max_tool_calls is not None:
        reader.max_calls = min(req.max_tool_calls, reader.max_calls or req.max_tool_calls)
    writer = ResponseWriter(_skeleton(ctx, req, response_id, plan, response_model(ctx, req.model, lora)))
    return Run(writer, choices, reader, conversation, input_items(req.input),
               store if req.store is not False else None)


def _skeleton(ctx: ServingContext, req: ResponsesRequest, response_id: str, plan: ToolPlan,
              model: str) -> dict[str, Any]:
    """The response object before any output (what ``response.created`` carries)."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": bool(req.background), "completed_at": None, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
        "model": model,
        "output": [], "parallel_tool_calls": plan.parallel, "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning or {"effort": None, "summary": None}, "service_tier": "default",
        "store": req.store is not False, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt}, "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
        "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled", "usage": None, "user": req.user,
    }


async def _events(ctx: ServingContext, run: Run) -> AsyncIterator[dict[str, Any]]:
    """Every event of the response, the last one ending it; stores it when asked to."""
    writer = run.writer
    for event in writer.start():
        yield event
    stream = run.reader.stream() if run.reader is not None else None
    sent, last = 0, None
    status, error, reason = "completed", None, None
    try:
        async for _, out in stream_outputs(ctx, run.choices):
            finish = stream_finish_reason(out["meta_info"])
            piece, sent = out["text"][sent:], len(out["text"])
            delta = stream.feed(piece, final=finish is not None) if stream is not None else ChatDelta(content=piece)
            for event in writer.feed(delta):
                yield event
            last = out
            if finish == "abort":
                raise aborted_error([out["meta_info"]])
            if finish == "length":
                status, reason = "incomplete", "max_output_tokens"
    except Exception as exc:
        log_stream_failure(f"response {writer.response['id']}", exc)
        run.failure = _api_error(exc)
        # OpenAI's error codes are a closed list: a request the engine refused is an invalid
        # prompt, anything else (an abort, a dead engine) a server error; the message says which.
        code = "invalid_prompt" if isinstance(exc, RequestError) else "server_error"
        status, error = "failed", {"code": code, "message": run.failure.message}
    usage = _usage(ctx, writer, last["meta_info"] if last else {})
    final = writer.finish(status, usage, error, reason, completed_at=int(time.time()))
    _save(run)  # before the last event: a client may send the follow-up as soon as it has it
    for event in final:
        yield event


def _api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead_error(exc)
    if isinstance(exc, ServerShuttingDownError):
        return shutting_down_error(exc)
    if isinstance(exc, RequestError):
        return from_request_error(exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def _usage(ctx: ServingContext, writer: ResponseWriter, meta: dict[str, Any]) -> dict[str, Any]:
    prompt, output = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    reasoning = writer.reasoning_text()
    # The reasoning's share of the output tokens, counted by re-tokenizing its text.
    reasoning_tokens = len(ctx.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning and ctx.tokenizer else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0),
                                                             "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output)},
            "total_tokens": prompt + output}


def _save(run: Run) -> None:
    if run.store is None:
        return
    entry = run.entry or StoredResponse(run.writer.response, rid=run.choices[0].request.rid,
                                        input_items=run.input_items)
    entry.conversation = run.conversation + conversation_of(run.writer.items)
    run.store.put(entry)


async def _run(ctx: ServingContext, run: Run) -> dict[str, Any]:
    async for _ in _events(ctx, run):
        pass
    return run.writer.response


async def _background(ctx: ServingContext, run: Run) -> None:
    run.writer.response["status"] = "in_progress"
    try:
        await _run(ctx, run)
    except asyncio.CancelledError:
        run.writer.finish("cancelled", None)  # the stream was closed, which aborted the request
        _save(run)
        raise


async def _sse(ctx: ServingContext, run: Run) -> AsyncIterator[bytes]:
    async for event in _events(ctx, run):
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        yield f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
