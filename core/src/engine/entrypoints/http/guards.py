"""The front door: CORS, API-key check and request-body size limit, as one ASGI middleware.

Pure ASGI (not Starlette's ``BaseHTTPMiddleware``) so streamed responses and
client-disconnect notifications pass through untouched. CORS (``--allowed-origins``) is the
outermost layer: a browser's preflight ``OPTIONS`` carries no credentials, so it is answered
before the key is checked, and the key check's 401 still carries the CORS headers (the
browser then shows the 401, not an opaque CORS failure).
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from engine.entrypoints.http.errors import APIError
from engine.managers.arrivals import Arrivals

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Load balancers probe /health without credentials; the live view's page and static files hold
# nothing secret (its data routes need the key, which the page sends).
OPEN_PATHS = frozenset({"/health", "/dashboard"})
OPEN_PREFIXES = ("/dashboard/static/",)
# The key when neither --api-key nor the YAML file gives one (keeps it out of `ps`).
API_KEY_ENV = "ENGINE_API_KEY"


def effective_api_key(api_key: str | None) -> str | None:
    """``--api-key`` (flag or YAML), else ``$ENGINE_API_KEY``; None (no key) when neither is set."""
    if api_key:
        return api_key
    return os.environ.get(API_KEY_ENV) or None


class FrontDoor:
    """Rejects unauthenticated requests (401) and oversized bodies (413) before any handler runs,
    and records each request's arrival (``Arrivals``) for a shutdown's drain."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 arrivals: Arrivals | None = None, allowed_origins: list[str] | None = None) -> None:
        self.app = app
        api_key = effective_api_key(api_key)
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.arrivals = arrivals
        self.entry: ASGIApp = self._checked
        if allowed_origins:
            from starlette.middleware.cors import CORSMiddleware

            # Credentials (cookies) are not how this API authenticates: the key is a header,
            # which the preflight lets through (allow_headers).
            self.entry = CORSMiddleware(self._checked, allow_origins=list(allowed_origins),  # type: ignore[arg-type]
                                        allow_methods=["*"], allow_headers=["*"], expose_headers=["*"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Recorded before anything is read or awaited: a shutdown drains what arrived before it.
        if self.arrivals is not None and self.arrivals.arrive():
            try:
                await self.entry(scope, receive, send)
            finally:
                self.arrivals.leave()
            return
        await self.entry(scope, receive, send)

    async def _checked(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or [])
        path = scope.get("path") or ""
        if self.expected is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = ("missing API key: send 'Authorization: Bearer <key>'" if not given
                           else "invalid API key")
                await _send_error(send, 401, message, "authentication_error", "invalid_api_key",
                                  [(b"www-authenticate", b"Bearer")])
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_error(send, 413, self._too_large(int(declared)), "invalid_request_error",
                              "request_too_large", [(b"connection", b"close")])
            return
        await self._call_limited(scope, receive, send)

    async def _call_limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Chunked uploads carry no content-length: count what actually arrives.
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # Raised into the handler reading the body; the app's APIError handler answers.
                    raise APIError(413, self._too_large(received), code="request_too_large")
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except APIError as exc:
            if started or exc.status != 413:
                raise
            await _send_error(send, 413, self._too_large(received), "invalid_request_error",
                              "request_too_large", [(b"connection", b"close")])

    def _too_large(self, size: int) -> str:
        return (f"the request body has {size} bytes or more; the limit is {self.max_body_bytes} bytes "
                f"({self.max_body_bytes // (1024 * 1024)} MiB)")


async def _send_error(send: Send, status: int, message: str, type_: str, code: str,
                      extra_headers: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
