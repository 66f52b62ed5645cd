"""The ``/v1`` routes: chat and text completions, models, tokenize and detokenize."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from engine.entrypoints.http.context import ServingContext
from engine.entrypoints.http.embeddings import check_generation_server
from engine.entrypoints.http.embeddings import router as embeddings_router
from engine.entrypoints.http.errors import APIError, parse_body
from engine.entrypoints.http.lora import router as lora_router
from engine.entrypoints.http.protocol import DetokenizeRequest, TokenizeRequest
from engine.entrypoints.http.responses import router as responses_router
from engine.entrypoints.http.scoring import router as scoring_router
from engine.entrypoints.http.serving_chat import create_chat_completion
from engine.entrypoints.http.serving_completions import create_completion

router = APIRouter()
router.include_router(responses_router)  # /v1/responses (OpenAI's Responses API)
router.include_router(scoring_router)  # /v1/rerank, /v1/score, /classify (docs/embeddings.md)
router.include_router(embeddings_router)  # /v1/embeddings and /encode (docs/embeddings.md)
router.include_router(lora_router)  # /load_lora_adapter, /unload_lora_adapter (docs/lora.md)


def serving_context(request: Request) -> ServingContext:
    return request.app.state.ctx  # set by the app's lifespan before any request is served


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions (``messages`` through the tokenizer's chat template)."""
    check_generation_server(serving_context(request), "/v1/chat/completions")
    return await create_chat_completion(serving_context(request), request)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    """OpenAI (legacy) text completions."""
    check_generation_server(serving_context(request), "/v1/completions")
    return await create_completion(serving_context(request), request)


def _model_card(ctx: ServingContext, adapter: str | None = None) -> dict[str, Any]:
    """The base model's card, or a LoRA adapter's: its name, its directory as ``root`` and the
    base model as ``parent`` (as vLLM lists adapters)."""
    if adapter is None:
        name, root, parent = ctx.model_name, ctx.model_path, None
    else:
        name, root, parent = adapter, ctx.manager.lora.adapters[adapter], ctx.model_name
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": "engine",
            "root": root, "parent": parent, "max_model_len": ctx.context_len}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """The base model, then the LoRA adapters loaded now."""
    ctx = serving_context(request)
    cards = [_model_card(ctx)] + [_model_card(ctx, a) for a in sorted(ctx.manager.lora.adapters)]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> Response:
    ctx = serving_context(request)
    return JSONResponse(_model_card(ctx, ctx.resolve_model(model)))


@router.post("/v1/tokenize")
async def tokenize(request: Request) -> Response:
    """Token ids of a prompt (or a batch of prompts), or of chat ``messages`` after the template."""
    ctx = serving_context(request)
    req = parse_body(await request.body(), TokenizeRequest)
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        if not req.messages:
            raise APIError(400, "messages: must contain at least one message", param="messages")
        ids = await ctx.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.context_len})
    if isinstance(req.prompt, str):
        ids = await ctx.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.context_len})
    batch = [await ctx.encode(p, f"prompt[{i}]", add_special_tokens=req.add_special_tokens)
             for i, p in enumerate(req.prompt or [])]
    return JSONResponse({"tokens": batch, "count": [len(b) for b in batch], "max_model_len": ctx.context_len})


@router.post("/v1/detokenize")
async def detokenize(request: Request) -> Response:
    """Text of token ids (or of a batch of id lists)."""
    ctx = serving_context(request)
    req = parse_body(await request.body(), DetokenizeRequest)
    ctx.check_model(req.model)
    tokenizer = ctx.require_tokenizer("tokens")
    tokens = req.tokens
    batch = bool(tokens) and isinstance(tokens[0], list)
    rows: list[list[int]] = tokens if batch else [tokens]  # type: ignore[list-item,assignment]
    for i, row in enumerate(rows):
        ctx.check_token_ids(row, f"tokens[{i}]" if batch else "tokens")
    texts = [tokenizer.decode(row, skip_special_tokens=req.skip_special_tokens) for row in rows]
    return JSONResponse({"text": texts if batch else texts[0]})
