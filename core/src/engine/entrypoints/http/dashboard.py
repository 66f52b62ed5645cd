"""The live view: ``GET /dashboard`` (a static page), its server-sent-events feed and timelines.

The page and its files (``dashboard_static/``, with uPlot vendored from npm) hold nothing
secret and load without the API key, so a browser can open them; the data (``/dashboard/feed``,
``/dashboard/requests/{rid}``) needs the key like every other route, which the page sends from
what its user typed (EventSource cannot send headers, so the page reads the feed with fetch).
Each feed event is built from the scheduler's ``server_info`` and ``requests`` control replies
and the tokenizer manager's in-flight requests (``live_view.LiveView``); nothing polls
``/metrics``. ``--disable-dashboard`` leaves the router out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.entrypoints.http.errors import APIError

router = APIRouter()

# Paths the front door lets through without the API key (the page and its static files).
OPEN_PATH = "/dashboard"
OPEN_PREFIX = "/dashboard/static/"
# Seconds between feed events (clients may ask for 0.25..10 with ?interval=).
DEFAULT_INTERVAL_S = 1.0
_STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".html": "text/html; charset=utf-8", ".LICENSE": "text/plain; charset=utf-8"}
_CONTROL_TIMEOUT_S = 5.0


def _static(name: str) -> bytes | None:
    path = resources.files("engine.entrypoints.http").joinpath("dashboard_static", name)
    return path.read_bytes() if path.is_file() else None


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> Response:
    body = _static("index.html")
    assert body is not None, "engine/entrypoints/http/dashboard_static/index.html is missing from the install"
    return Response(body, media_type=_STATIC_TYPES[".html"], headers={"cache-control": "no-cache"})


@router.get("/dashboard/static/{name}", include_in_schema=False)
async def dashboard_static(name: str) -> Response:
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    body = _static(name) if "/" not in name and not name.startswith(".") and suffix in _STATIC_TYPES else None
    if body is None:
        raise APIError(404, f"no dashboard file '{name}'", code="not_found")
    return Response(body, media_type=_STATIC_TYPES[suffix], headers={"cache-control": "max-age=3600"})


async def _replies(ctx: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The merged ``server_info`` reply and each replica's ``requests`` reply."""
    info, live = await asyncio.gather(ctx.manager.control("server_info", timeout=_CONTROL_TIMEOUT_S),
                                      ctx.manager.control_replicas("requests", timeout=_CONTROL_TIMEOUT_S))
    return info.data, [reply.data for reply in live]


async def next_event(ctx: Any) -> dict[str, Any]:
    """One feed event (also what ``/dashboard/feed?once=1`` answers)."""
    info, live = await _replies(ctx)
    if ctx.metrics is not None:  # /metrics' gauges stay as fresh as the view
        ctx.metrics.update_from_server_info(info)
    return ctx.live_view.snapshot(info, live, ctx.manager.states)


def _interval(request: Request) -> float:
    raw = request.query_params.get("interval")
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.25 <= value <= 10:
        raise APIError(400, f"interval: invalid value {raw!r}; accepted: seconds between 0.25 and 10",
                       param="interval")
    return value


@router.get("/dashboard/feed", include_in_schema=False)
async def dashboard_feed(request: Request) -> Response:
    """Server-sent events, one ``data:`` JSON object per interval, until the client leaves or
    the server starts draining; ``?once=1`` answers one event as plain JSON."""
    ctx = request.app.state.ctx
    ctx.check_alive()
    interval = _interval(request)
    if request.query_params.get("once") in ("1", "true"):
        return JSONResponse(await next_event(ctx))

    async def events() -> AsyncIterator[bytes]:
        yield b"retry: 2000\n\n"
        while not ctx.manager.draining and ctx.manager.dead is None:
            try:
                event = await next_event(ctx)
            except (asyncio.TimeoutError, RuntimeError) as exc:  # a busy scheduler: say so, keep going
                event = {"error": f"the scheduler did not answer: {type(exc).__name__}"}
            yield f"data: {json.dumps(event)}\n\n".encode()
            # Short sleeps: a shutdown's drain ends the feed within a quarter second.
            for _ in range(max(1, round(interval / 0.25))):
                if ctx.manager.draining:  # a client that leaves cancels this generator (Starlette)
                    return
                await asyncio.sleep(0.25)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


@router.get("/dashboard/requests/{rid}", include_in_schema=False)
async def dashboard_request(request: Request, rid: str) -> Response:
    """One request's timeline: in flight, or among the last finished ones."""
    ctx = request.app.state.ctx
    ctx.check_alive()
    live: list[dict[str, Any]] = []
    if rid in ctx.manager.states:
        live = [r.data for r in await ctx.manager.control_replicas("requests", timeout=_CONTROL_TIMEOUT_S)]
    timeline = ctx.live_view.timeline(rid, live, ctx.manager.states)
    if timeline is None:
        raise APIError(404, f"rid: no request '{rid}' is running or among the last finished ones",
                       param="rid", code="not_found")
    return JSONResponse(timeline)
