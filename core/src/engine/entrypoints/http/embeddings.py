"""``POST /v1/embeddings`` (OpenAI's shape) and SGLang's native ``POST /encode``.

Both run through ``TokenizerManager.embed`` (docs/embeddings.md). OpenAI's ``encoding_format``
``base64`` is the vector's float32 values, little-endian, base64-encoded: what the ``openai``
client asks for by default and decodes with ``numpy.frombuffer(..., dtype="float32")``.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, Response

from engine.entrypoints.http.context import ServingContext
from engine.entrypoints.http.errors import APIError, parse_body
from engine.managers.tokenizer_embed import EmbeddingRequest, EmbeddingResult

router = APIRouter()

_ACCEPTED_INPUT = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


class EmbeddingsBody(BaseModel):
    """OpenAI's embeddings request (https://platform.openai.com/docs/api-reference/embeddings/create)."""

    model_config = ConfigDict(extra="forbid")

    input: Any = None
    model: str | None = None
    # "float" (a JSON list; also when null) or "base64" (float32 little-endian bytes).
    encoding_format: str | None = "float"
    # Matryoshka truncation (normalised after truncating); None: the model's size.
    dimensions: int | None = None
    # A caller's end-user id: accepted, recorded nowhere.
    user: str | None = None


class EncodeBody(BaseModel):
    """SGLang's ``/encode``: ``text`` (a string or a list) or ``input_ids`` (a list, or a list of lists)."""

    model_config = ConfigDict(extra="forbid")

    text: Any = None
    input_ids: Any = None
    rid: str | None = None
    dimensions: int | None = None


def serving_context(request: Request) -> ServingContext:
    return request.app.state.ctx


def check_generation_server(ctx: ServingContext, route: str) -> None:
    """A 400 naming ``model`` for a generation route (``route``) on a pooling server."""
    task = getattr(ctx.ready, "task", "generate")
    if task != "generate":
        raise APIError(400, f"{route}: this server serves an embedding/scoring model (--task {task}), which cannot "
                       "generate; use /v1/embeddings, or serve a generation model (--task generate)", param="model")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def openai_inputs(value: Any) -> list[Any]:
    """``input`` as a list of texts or id lists; anything else is a 400 naming the field."""
    if isinstance(value, str):
        return [value]
    if _is_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or _is_ids(v) for v in value):
        return list(value)
    if value is None:
        raise APIError(400, f"input: required; accepted: {_ACCEPTED_INPUT}", param="input")
    if value == []:
        raise APIError(400, f"input: the list is empty; accepted: {_ACCEPTED_INPUT}", param="input")
    if isinstance(value, list):
        bad = next(i for i, v in enumerate(value) if not (isinstance(v, str) or _is_ids(v)))
        raise APIError(400, f"input[{bad}]: invalid value {value[bad]!r:.60}; accepted: {_ACCEPTED_INPUT}",
                       param="input")
    raise APIError(400, f"input: invalid value of type {type(value).__name__}; accepted: {_ACCEPTED_INPUT}",
                   param="input")


def encode_base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> Response:
    """Vectors of the inputs, in input order, with token usage."""
    ctx = serving_context(request)
    body = parse_body(await request.body(), EmbeddingsBody)
    ctx.check_model(body.model)
    fmt = body.encoding_format or "float"
    if fmt not in ("float", "base64"):
        raise APIError(400, f"encoding_format: invalid value {body.encoding_format!r}; accepted: float, base64",
                       param="encoding_format")
    inputs = openai_inputs(body.input)
    ctx.check_accepting()
    results = await ctx.manager.embed(EmbeddingRequest(inputs=inputs, dimensions=body.dimensions))
    data = [{"object": "embedding", "index": r.index,
             "embedding": encode_base64(r.embedding) if fmt == "base64" else r.embedding} for r in results]
    tokens = sum(r.prompt_tokens for r in results)
    return JSONResponse({"object": "list", "data": data, "model": ctx.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _native_output(result: EmbeddingResult, started: float) -> dict[str, Any]:
    return {"embedding": result.embedding,
            "meta_info": {"prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
                          "e2e_latency": time.perf_counter() - started}}


@router.post("/encode")
async def encode(request: Request) -> Response:
    """SGLang's native embedding route: one dict for one input, a list for a batch."""
    ctx = serving_context(request)
    started = time.perf_counter()
    body = parse_body(await request.body(), EncodeBody)
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids", param="text")
    field = "text" if body.text is not None else "input_ids"
    value = body.text if body.text is not None else body.input_ids
    single = isinstance(value, str) or _is_ids(value)
    if field == "text" and not (single or (isinstance(value, list) and value and all(isinstance(v, str) for v in value))):
        raise APIError(400, "text: accepted: a string or a non-empty list of strings", param="text")
    if field == "input_ids" and not (single or (isinstance(value, list) and value and all(_is_ids(v) for v in value))):
        raise APIError(400, "input_ids: accepted: a list of token ids or a non-empty list of them", param="input_ids")
    ctx.check_accepting()
    inputs = [value] if single else list(value)
    results = await ctx.manager.embed(EmbeddingRequest(inputs=inputs, dimensions=body.dimensions, rid=body.rid,
                                                       field_name=field))
    outputs = [_native_output(r, started) for r in results]
    return JSONResponse(outputs[0] if single else outputs)
