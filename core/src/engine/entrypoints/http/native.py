"""SGLang's native routes: /generate, /abort_request, /flush_cache, /health, /get_server_info,
/get_model_info and /metrics.

They live beside the OpenAI routes because they share the request runner, the
error bodies and the serving context of this package.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from engine.version import __version__
from engine.entrypoints.http.context import ServingContext
from engine.entrypoints.http.errors import APIError, engine_dead_error, parse_body, shutting_down_error
from engine.entrypoints.http.generation import (
    SSE_DONE,
    Choice,
    aborted_error,
    encode_json,
    log_stream_failure,
    make_choices,
    run_to_completion,
    sse_error,
    sse_response,
    stream_finish_reason,
    stream_outputs,
)
from engine.entrypoints.http.logprobs import native_logprobs, native_top_logprobs
from engine.entrypoints.http.native_request import build_requests
from engine.entrypoints.http.protocol import AbortRequest, GenerateReqInput
from engine.managers.tokenizer_manager import EngineDeadError

logger = logging.getLogger(__name__)

router = APIRouter()

# /health fails when the scheduler does not answer within this many seconds.
HEALTH_TIMEOUT_S = 5.0
# /metrics and /get_server_info wait this long for the scheduler's numbers.
_INFO_TIMEOUT_S = 5.0


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


@router.post("/generate")
async def generate(request: Request) -> Response:
    """One prompt (``text`` or ``input_ids``) or a batch; streamed as SSE with ``stream``."""
    ctx = _ctx(request)
    req = parse_body(await request.body(), GenerateReqInput)
    prompts, copies, batch = build_requests(ctx, req)
    choices = await make_choices(ctx, prompts, copies)
    batch = batch or len(choices) > 1
    if req.stream:
        return sse_response(ctx, choices, _stream(ctx, req, choices, batch))
    outputs = await run_to_completion(ctx, choices, request)
    bodies = [_output(ctx, req, out) for out in outputs]
    aborted = [out["meta_info"] for out in outputs if stream_finish_reason(out["meta_info"]) == "abort"]
    if aborted:  # a 400, whose body also holds the outputs: meta_info.finish_reason is {"type": "abort"}
        error = aborted_error(aborted)
        error.extra = bodies[0] if not batch else {"outputs": bodies}
        raise error
    return JSONResponse(bodies if batch else bodies[0])


def _output(ctx: ServingContext, req: GenerateReqInput, out: dict[str, Any]) -> dict[str, Any]:
    """SGLang's output dict; logprob entries become ``[logprob, token_id, text_or_null]``."""
    meta = dict(out["meta_info"])
    text_of = ctx.token_text if req.return_text_in_logprobs else None
    for key in ("output_token_logprobs", "input_token_logprobs"):
        if key in meta:
            meta[key] = native_logprobs(meta[key], text_of)
    for key in ("output_top_logprobs", "input_top_logprobs"):
        if key in meta:
            meta[key] = native_top_logprobs(meta[key], text_of)
    return {"text": out["text"], "output_ids": out["output_ids"], "meta_info": meta}


class _IdsJSON:
    """A stream's cumulative ``output_ids`` as JSON, extended by each event's new ids.

    Every event of a /generate stream carries all ids so far; encoding only the new ones keeps
    an event's cost independent of how long the stream has run (re-encoding the whole list made
    it the largest cost of the HTTP process per streamed token)."""

    __slots__ = ("count", "text")

    def __init__(self) -> None:
        self.count = 0
        self.text = ""

    def encode(self, ids: list[int]) -> str:
        if len(ids) < self.count:  # never happens (ids only grow); stay correct if it did
            self.count, self.text = 0, ""
        if len(ids) > self.count:
            new = ",".join(map(str, ids[self.count:]))
            self.text = f"{self.text},{new}" if self.count else new
            self.count = len(ids)
        return self.text


def _sse_event(body: dict[str, Any], ids: _IdsJSON) -> bytes:
    """``sse(body)``'s bytes, with ``output_ids`` encoded incrementally."""
    parts = [f'"{key}":[{ids.encode(value)}]' if key == "output_ids" else f"{encode_json(key)}:{encode_json(value)}"
             for key, value in body.items()]
    return f"data: {{{','.join(parts)}}}\n\n".encode()


async def _stream(ctx: ServingContext, req: GenerateReqInput, choices: list[Choice], batch: bool) -> AsyncIterator[bytes]:
    aborted: list[dict[str, Any]] = []
    ids = {choice.index: _IdsJSON() for choice in choices}
    try:
        async for choice, out in stream_outputs(ctx, choices):
            body = _output(ctx, req, out)
            if batch:
                body["index"] = choice.index
            # An aborted choice's last event carries finish_reason {"type": "abort"}, as SGLang's.
            if stream_finish_reason(out["meta_info"]) == "abort":
                aborted.append(out["meta_info"])
            yield _sse_event(body, ids[choice.index])
        if aborted:
            yield sse_error(aborted_error(aborted))
    except Exception as exc:
        log_stream_failure("generate stream", exc)
        yield sse_error(exc)
    yield SSE_DONE


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """Aborts a request by ``rid`` — a request's own id aborts all its choices (``n`` > 1, a
    batch) — or every request with ``abort_all``. An id that nothing runs under is a 404."""
    ctx = _ctx(request)
    req = parse_body(await request.body(), AbortRequest)
    if not req.rid and not req.abort_all:
        raise APIError(400, "rid: required (or abort_all: true)", param="rid")
    ctx.check_alive()
    aborted = ctx.manager.abort("" if req.abort_all else req.rid)
    if not aborted and not req.abort_all:
        raise APIError(404, f"rid: no running request has id '{req.rid}' (it finished, was never sent, "
                            "or the id is misspelt)", param="rid", code="request_not_found")
    return JSONResponse({"success": True, "aborted": aborted})


# One route per method: a single route with both methods gives both the same OpenAPI
# operation id, which FastAPI warns about each time /openapi.json is built.
@router.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    """Empties the prefix cache; refused while requests are running or queued."""
    return await _flush_cache(_ctx(request))


@router.get("/flush_cache")
async def flush_cache_get(request: Request) -> Response:
    """``GET /flush_cache``, as SGLang also allows."""
    return await _flush_cache(_ctx(request))


async def _flush_cache(ctx: ServingContext) -> Response:
    reply = await _control(ctx, "flush_cache")
    if not reply.ok:
        raise APIError(400, "cannot flush the cache while requests are running or queued; retry when idle",
                       code="cache_busy")
    return JSONResponse({"success": True, "message": "cache flushed"})


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when the scheduler answers a health check in time, else 503."""
    await check_health(_ctx(request))
    return JSONResponse({"status": "ok"})


async def check_health(ctx: ServingContext) -> None:
    """Returns when the scheduler answers a health check in time; a 503 otherwise (also while
    the server drains, so load balancers stop sending). The gRPC frontend's Health calls it too."""
    if ctx.manager.draining:
        raise shutting_down_error("the server is shutting down")
    try:
        await _control(ctx, "health", HEALTH_TIMEOUT_S)
    except APIError as exc:
        raise APIError(503, f"unhealthy: {exc.message}") from None


@router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    """Effective configuration, loaded plugins and the KV pool's size and use, in SGLang's shape."""
    return JSONResponse(await _server_info(_ctx(request)))


@router.get("/server_info")
async def server_info(request: Request) -> Response:
    """SGLang's newer name for /get_server_info (its current clients read this one)."""
    return JSONResponse(await _server_info(_ctx(request)))


async def _server_info(ctx: ServingContext) -> dict[str, Any]:
    """SGLang's layout: the server's arguments and the scheduler's numbers at the top level
    (summed over the data-parallel replicas, each one's in ``dp_replicas``), and
    ``internal_states``, one entry per data-parallel replica, which SGLang clients index
    (``bench_serving`` reads ``internal_states[0]["avg_spec_accept_length"]``); ``router``: the
    router policy and, per replica, the requests routed there and its load."""
    reply = await _control(ctx, "server_info")
    if ctx.metrics is not None:
        ctx.metrics.update_from_server_info(reply.data)
    ready = ctx.ready
    config = ctx.args.to_dict()
    if config.get("api_key"):
        config["api_key"] = "<redacted>"
    live: dict[str, Any] = reply.data
    replicas = live.get("dp_replicas") or [live]
    internal_states = [_internal_state(config, replica, ready.max_total_num_tokens) for replica in replicas]
    router = ctx.manager.router.stats()
    if ctx.metrics is not None:
        ctx.metrics.update_router(router)
    for entry, replica in zip(router["replicas"], replicas):
        entry.update({key: replica.get(key, 0) for key in _REPLICA_LOAD_KEYS})
    return {
        **config, **live, "version": __version__, "model_path": ctx.model_path,
        "served_model_name": ctx.model_name, "context_len": ready.context_len,
        "max_req_input_len": ready.context_len - 1, "vocab_size": ready.vocab_size,
        "attention_backend": ready.attention_backend, "platform": ready.platform, "device": ready.device,
        "dtype": ready.dtype, "max_running_requests": ready.max_running_requests, "plugins": ready.plugins,
        "num_inflight_reqs": len(ctx.manager.states), "internal_states": internal_states, "router": router,
    }


# A replica's numbers copied into ``router.replicas[i]`` of /get_server_info (its load at a glance).
_REPLICA_LOAD_KEYS = ("num_running_reqs", "num_waiting_reqs", "kv_usage", "kv_used_tokens", "max_total_num_tokens")


def _internal_state(config: dict[str, Any], live: dict[str, Any], capacity: int) -> dict[str, Any]:
    """One entry of ``internal_states``: a data-parallel replica's configuration and numbers."""
    decode_time = live.get("decode_time_s") or 0.0
    return {
        **config, **live,
        # SGLang reports its last log interval; the scheduler keeps totals, so this is the
        # mean over every decode step so far: tokens decoded per second of decode time.
        "last_gen_throughput": live.get("decode_rows", 0) / decode_time if decode_time else 0.0,
        "memory_usage": {"token_capacity": live.get("max_total_num_tokens", capacity)},
        # No speculative decoding here, so no avg_spec_accept_length (SGLang omits it too).
    }


def _model_info(ctx: ServingContext) -> dict[str, Any]:
    # The chat template and the special tokens it refers to let a client (the frontend language)
    # render chat roles itself exactly as the server's /v1/chat/completions does.
    tokenizer = ctx.tokenizer
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    return {"model_path": ctx.model_path, "served_model_name": ctx.model_name,
            "tokenizer_path": ctx.args.tokenizer_path or ctx.model_path,
            # SGLang's flag: False for an embedding or scoring model (--task embed|score).
            "is_generation": getattr(ctx.ready, "task", "generate") == "generate",
            "task": getattr(ctx.ready, "task", "generate"),
            "context_len": ctx.context_len, "chat_template": getattr(tokenizer, "chat_template", None) or None,
            "special_tokens": {k: v for k, v in special.items() if isinstance(v, str)}}


@router.get("/get_model_info")
async def get_model_info(request: Request) -> Response:
    return JSONResponse(_model_info(_ctx(request)))


@router.get("/model_info")
async def model_info(request: Request) -> Response:
    """SGLang's newer name for /get_model_info."""
    return JSONResponse(_model_info(_ctx(request)))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format; gauges refreshed from the scheduler when it answers."""
    from engine.metrics import CONTENT_TYPE

    ctx = _ctx(request)
    assert ctx.metrics is not None
    ctx.metrics.update_router(ctx.manager.router.stats())
    try:
        reply = await _control(ctx, "server_info")
        ctx.metrics.update_from_server_info(reply.data)
    except APIError:
        pass  # a busy or dead scheduler: serve the counters with the last gauges
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


async def _control(ctx: ServingContext, kind: str, timeout: float = _INFO_TIMEOUT_S) -> Any:
    ctx.check_alive()
    try:
        return await ctx.manager.control(kind, timeout=timeout)
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from None
    except asyncio.TimeoutError:
        raise APIError(503, f"the scheduler did not answer '{kind}' within {timeout:g} s",
                       code="scheduler_timeout") from None
