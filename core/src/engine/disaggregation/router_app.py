"""The router's HTTP server: the generation routes of both APIs, /health, /v1/models and
/get_server_info (``engine router``; ``engine.disaggregation.router`` does the routing).

FastAPI reads the handlers' annotations by name from this module: its types are imported here,
at the top."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.disaggregation.router import (
    _CONNECT_TIMEOUT_S,
    DEFAULT_POLICY,
    ROUTES,
    PDRouter,
    PrefillServer,
    RouterError,
    route,
)
from engine.errors import ConfigError

_DISCONNECT_POLL_S = 0.5


def create_app(router: PDRouter) -> Any:
    import httpx

    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        # No read time-out: a long generation streams for as long as it takes; a dead server is
        # seen at once by its closed connection.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        # trust_env=False: the servers are reached directly, never through a proxy of the environment.
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=_CONNECT_TIMEOUT_S), limits=limits,
                                     trust_env=False) as client:
            state["client"] = client
            yield

    app = FastAPI(title="engine router (prefill/decode)", lifespan=lifespan)

    if router.api_key:
        @app.middleware("http")
        async def require_key(request: Request, call_next: Any) -> Response:
            if request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {router.api_key}":
                err = RouterError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' (the router's --api-key)")
                return JSONResponse(err.body, status_code=401)
            return await call_next(request)

    async def generate(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(RouterError(400, "the request body is not valid JSON").body, status_code=400)
        task = asyncio.ensure_future(route(state["client"], router, request.url.path, body))
        # A client that goes away before the answer: cancelling closes both halves' connections,
        # which aborts the request on both servers (a stream's disconnect closes its relay instead).
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        try:
            status, data = task.result()
        except RouterError as err:
            return JSONResponse(err.body, status_code=err.status)
        if status == 200 and not isinstance(data, (dict, list)):
            return StreamingResponse(data, media_type="text/event-stream")
        return JSONResponse(data, status_code=status)

    for path in ROUTES:
        app.add_api_route(path, generate, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        urls = [p.url for p in router.prefill] + list(router.decode)
        results = await asyncio.gather(*(_get(state["client"], u + "/health", router) for u in urls))
        down = [u for u, (status, _) in zip(urls, results, strict=True) if status != 200]
        if down:
            return JSONResponse(RouterError(503, f"not healthy: {', '.join(down)}").body, status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        status, data = await _get(state["client"], router.decode[0] + "/v1/models", router)
        return JSONResponse(data, status_code=status)

    @app.get("/get_server_info")
    async def server_info() -> Response:
        return JSONResponse({"router": router.stats()})

    return app


async def _get(client: Any, url: str, router: PDRouter) -> tuple[int, Any]:
    try:
        r = await client.get(url, headers=router.headers(), timeout=_CONNECT_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001
        return 502, RouterError(502, f"{url}: {type(exc).__name__}: {exc}").body
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


def discover(prefill_urls: list[str], decode_urls: list[str], api_key: str | None, wait_s: float,
             policy: str = DEFAULT_POLICY, decode_policy: str | None = None) -> PDRouter:
    """Asks every server its --disaggregation-mode (and a prefill server its bootstrap port),
    waiting up to ``wait_s`` for servers still starting; a server of the wrong mode, or one that
    never answers, is a ConfigError naming it. ``policy``: the router policy of both kinds
    (``decode_policy``, when given, of decode servers)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def info(url: str, flag: str) -> dict[str, Any]:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                r = httpx.get(url.rstrip("/") + "/get_server_info", headers=headers, timeout=_CONNECT_TIMEOUT_S,
                              trust_env=False)
                if r.status_code == 200:
                    return r.json()
                problem = f"/get_server_info answered {r.status_code}"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ConfigError(f"{flag} {url}: no answer within {wait_s:g} s ({problem})")
            time.sleep(0.5)

    prefill = []
    for url in prefill_urls:
        data = info(url, "--prefill")
        if data.get("disaggregation_mode") != "prefill":
            raise ConfigError(f"--prefill {url}: that server runs --disaggregation-mode "
                              f"{data.get('disaggregation_mode')!r}; accepted: a server started with "
                              "--disaggregation-mode prefill")
        prefill.append(PrefillServer(url.rstrip("/"), int(data["disaggregation_bootstrap_port"])))
    for url in decode_urls:
        mode = info(url, "--decode").get("disaggregation_mode")
        if mode != "decode":
            raise ConfigError(f"--decode {url}: that server runs --disaggregation-mode {mode!r}; accepted: a server "
                              "started with --disaggregation-mode decode")
    return PDRouter(prefill, [u.rstrip("/") for u in decode_urls], api_key, policy, decode_policy)
