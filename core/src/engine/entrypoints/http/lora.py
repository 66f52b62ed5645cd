"""LoRA adapters at run time: ``POST /load_lora_adapter`` and ``POST /unload_lora_adapter``
(SGLang's routes and bodies), also under vLLM's ``/v1/...`` names (docs/lora.md).

Both answer 200 with SGLang's body ``{"success": true, "message", "loaded_adapters": {name:
path}}``, or an OpenAI error body (400 naming the field and value) that also carries
``success: false`` and ``loaded_adapters``, which SGLang's clients read. Like every route but
/health they are behind --api-key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from engine.entrypoints.http.context import ServingContext
from engine.entrypoints.http.errors import APIError, engine_dead_error, from_request_error, parse_body
from engine.entrypoints.http.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from engine.managers.tokenizer_manager import LORA_TIMEOUT_S, EngineDeadError, RequestError

router = APIRouter()


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """Loads a PEFT adapter directory under a name requests then select it by."""
    ctx = _ctx(request)
    with _refusals(ctx, "load_lora_adapter"):
        req = parse_body(await request.body(), LoadLoraAdapterRequest)
        if req.load_inplace:
            raise APIError(400, "load_inplace: true is not supported; accepted: false (unload the adapter, then "
                                "load the new weights)", param="load_inplace", code="unsupported_feature")
        if req.lora_name in (ctx.model_name, ctx.model_path):
            raise APIError(400, f"lora_name: invalid value {req.lora_name!r}: it is the base model's name; "
                                "accepted: any other name", param="lora_name")
        ctx.check_alive()
        loaded = await ctx.manager.load_lora_adapter(req.lora_name, req.lora_path, req.pinned)
    return _success(f"LoRA adapter '{req.lora_name}' loaded from {req.lora_path}", loaded)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    """Unloads an adapter: new requests naming it get a 400, those running on it finish."""
    ctx = _ctx(request)
    with _refusals(ctx, "unload_lora_adapter"):
        req = parse_body(await request.body(), UnloadLoraAdapterRequest)
        ctx.check_alive()
        loaded = await ctx.manager.unload_lora_adapter(req.lora_name)
    return _success(f"LoRA adapter '{req.lora_name}' unloaded", loaded)


# vLLM's names for the same routes (its clients and docs use these).
router.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"],
                     operation_id="v1_load_lora_adapter")
router.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"],
                     operation_id="v1_unload_lora_adapter")


def _success(message: str, loaded: dict[str, str]) -> Response:
    return JSONResponse({"success": True, "message": message, "loaded_adapters": loaded})


@contextmanager
def _refusals(ctx: ServingContext, what: str) -> Iterator[None]:
    """Errors as OpenAI bodies; a 400 also carries SGLang's ``success`` and ``loaded_adapters``."""
    try:
        yield
    except RequestError as exc:
        raise _with_loaded(ctx, from_request_error(exc)) from None
    except APIError as exc:
        raise _with_loaded(ctx, exc) if exc.status == 400 else exc from None
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from None
    except asyncio.TimeoutError:
        raise APIError(503, f"the scheduler did not answer {what} within {LORA_TIMEOUT_S:g} s; GET /v1/models "
                            "lists the adapters loaded now", code="scheduler_timeout") from None


def _with_loaded(ctx: ServingContext, error: APIError) -> APIError:
    error.extra = {"success": False, "loaded_adapters": dict(ctx.manager.lora.adapters)}
    return error
