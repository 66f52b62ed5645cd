"""The routes on stored responses: ``GET /v1/responses/{id}`` (and its ``input_items``),
``DELETE`` and ``POST .../cancel`` (a background response's engine request is aborted)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from engine.entrypoints.http.errors import APIError
from engine.entrypoints.http.responses_store import StoredResponse, store_of

router = APIRouter()


def _stored(request: Request, response_id: str) -> StoredResponse:
    entry = store_of(request.app.state).get(response_id)
    if entry is None:
        raise APIError(404, f"response '{response_id}' not found (never stored, deleted, or evicted)",
                       param="response_id", code="response_not_found")
    return entry


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> Response:
    if request.query_params.get("stream") in ("true", "1"):
        raise APIError(400, "stream: replaying a stored response's events is not supported; GET it without stream",
                       param="stream")
    return JSONResponse(_stored(request, response_id).response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request) -> Response:
    """The response's input items (OpenAI's cursor list: ``order``, ``limit``, ``after``)."""
    items = _stored(request, response_id).input_items
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: invalid value {order!r}; accepted: asc, desc", param="order")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise APIError(400, f"limit: invalid value {limit!r}; accepted: 1..100", param="limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"after: no input item '{after}' in response '{response_id}'", param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:int(limit)]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > len(page)})


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    entry = _stored(request, response_id)
    if entry.running:
        entry.task.cancel()  # type: ignore[union-attr]
    store_of(request.app.state).delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    """Cancels a background response still running (its engine request is aborted)."""
    entry = _stored(request, response_id)
    if entry.task is None:
        raise APIError(400, f"response '{response_id}' was not created with background: true; only background "
                            "responses can be cancelled", param="response_id")
    if entry.running:
        entry.task.cancel()
        await asyncio.gather(entry.task, return_exceptions=True)
        if entry.response["status"] in ("queued", "in_progress"):  # cancelled before it began
            entry.response["status"] = "cancelled"
    elif entry.response["status"] != "cancelled":
        raise APIError(400, f"response '{response_id}' is already {entry.response['status']} and cannot be "
                            "cancelled", param="response_id")
    return JSONResponse(entry.response)
