"""Frontends beside HTTP (``engine serve --grpc-port N``): how the server runs them, and
``NativeAPI``, the native API they serve.

A frontend is a distribution declaring an entry point in the group ``engine.frontends``
(plugserve-grpc: ``grpc = "engine_grpc.server:start"``); ``engine.preflight.FRONTENDS`` maps
each name to the ``ServerArgs`` field that turns it on. Once the HTTP server accepts
connections, the server loads the entry point of each frontend turned on and awaits
``start(api, host, port)`` on its own event loop; ``api`` is a ``NativeAPI`` over the tokenizer
manager the HTTP routes use, running the same validation and request code as ``/generate``, so a
request behaves the same whichever door it came through. ``start`` returns an object with
``async stop(grace_s: float | None)``, which the server awaits when it shuts down: at the start
of the drain with the grace period (stop accepting calls, let those in flight finish), and
with None when there is nothing to drain.

Public for frontend plugins: ``NativeAPI`` and ``APIError`` (its ``status``, ``message``,
``param`` and ``code``: HTTP's status and OpenAI's error fields).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from engine.entrypoints.http.errors import (
    APIError,
    engine_dead_error,
    from_request_error,
    from_validation_error,
    shutting_down_error,
)
from engine.entrypoints.http.generation import Choice, make_choices, stream_outputs
from engine.entrypoints.http.guards import effective_api_key
from engine.entrypoints.http.native import _model_info, _output, _server_info, check_health
from engine.entrypoints.http.native_request import build_requests
from engine.entrypoints.http.protocol import GenerateReqInput
from engine.managers.tokenizer_embed import EmbeddingRequest
from engine.managers.tokenizer_manager import EngineDeadError, RequestError, ServerShuttingDownError
from engine.preflight import enabled_frontends, frontend_entry_point

if TYPE_CHECKING:
    from engine.entrypoints.http.context import ServingContext

logger = logging.getLogger("engine.server")


class RunningFrontend(Protocol):
    """What a frontend's ``start`` returns."""

    async def stop(self, grace_s: float | None) -> None:
        """Stops accepting calls; those in flight get ``grace_s`` seconds (None: none) to finish."""


class NativeAPI:
    """SGLang's native API (``/generate``, ``/encode``, ``/abort_request``, ``/health``,
    ``/get_model_info``, ``/get_server_info``) as methods taking and returning what those routes take and return.

    Every method raises ``APIError`` for a request that fails, with the status and the message
    (naming the field) the HTTP route would answer.
    """

    def __init__(self, ctx: ServingContext) -> None:
        self._ctx = ctx
        key = effective_api_key(ctx.args.api_key)
        self._expected = f"Bearer {key}".encode() if key else None

    @property
    def model_name(self) -> str:
        return self._ctx.model_name

    def authorize(self, authorization: str | None) -> None:
        """401 unless ``authorization`` is ``Bearer KEY`` for the server's API key (when it has one)."""
        if self._expected is None:
            return
        given = (authorization or "").encode()
        if not hmac.compare_digest(given, self._expected):
            raise APIError(401, "missing API key: send 'authorization: Bearer <key>'" if not given
                           else "invalid API key", code="invalid_api_key")

    @contextmanager
    def arrival(self) -> Iterator[None]:
        """Wraps the handling of one call: a shutdown's drain waits for it (as for an HTTP request
        received before the drain began); a call arriving after the drain began gets a 503."""
        arrivals = self._ctx.manager.arrivals
        if not arrivals.arrive():
            raise shutting_down_error("the server is shutting down and accepts no new requests; "
                                      "retry on another replica")
        try:
            yield
        finally:
            arrivals.leave()

    async def generate(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Runs a ``/generate`` body. Yields ``{"index", "text", "output_ids", "meta_info"}``
        (``text`` and ``output_ids`` cumulative, as /generate streams them): with ``stream``
        after every increment of each choice, else each choice's final output in order.

        An aborted choice ends with ``meta_info.finish_reason.type == "abort"``. Closing the
        generator (or cancelling its consumer) aborts the choices still running.
        """
        ctx = self._ctx
        try:
            req = GenerateReqInput.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc, GenerateReqInput) from None
        prompts, copies, _ = build_requests(ctx, req)
        choices = await make_choices(ctx, prompts, copies)
        try:
            if req.stream:
                outputs = stream_outputs(ctx, choices)
                try:
                    async for choice, out in outputs:
                        yield {"index": choice.index, **_output(ctx, req, out)}
                finally:
                    # Closed now, not when collected: the abort (and freeing the KV) is immediate.
                    await outputs.aclose()
            else:
                for choice, out in zip(choices, await _final_outputs(ctx, choices), strict=True):
                    yield {"index": choice.index, **_output(ctx, req, out)}
        except (EngineDeadError, ServerShuttingDownError, RequestError) as exc:
            raise _api_error(exc) from None

    async def embed(self, inputs: list[str | list[int]], dimensions: int | None = None, rid: str | None = None,
                    field_name: str = "text") -> list[dict[str, Any]]:
        """``/encode``: pools each input (a text or token ids) on a server of ``--task embed`` or
        ``score``; returns ``{"index", "embedding", "prompt_tokens", "cached_tokens"}`` per input,
        in order. ``field_name`` is the field errors name for the inputs."""
        ctx = self._ctx
        ctx.check_accepting()
        request = EmbeddingRequest(inputs=list(inputs), dimensions=dimensions, rid=rid or None, field_name=field_name)
        try:
            results = await ctx.manager.embed(request)
        except (EngineDeadError, ServerShuttingDownError, RequestError) as exc:
            raise _api_error(exc) from None
        return [{"index": r.index, "embedding": r.embedding, "prompt_tokens": r.prompt_tokens,
                 "cached_tokens": r.cached_tokens} for r in results]

    def abort(self, rid: str) -> list[str]:
        """Aborts the request ``rid`` (or every request a request's own id stands for: its ``n``
        choices); returns the ids aborted. 404 when nothing runs under that id."""
        if not rid:
            raise APIError(400, "rid: required, the id of a running request", param="rid")
        self._ctx.check_alive()
        aborted = self._ctx.manager.abort(rid)
        if not aborted:
            raise APIError(404, f"rid: no running request has id '{rid}' (it finished, was never sent, "
                                "or the id is misspelt)", param="rid", code="request_not_found")
        return aborted

    async def health(self) -> None:
        """Returns when the scheduler answers a health check in time; 503 otherwise."""
        await check_health(self._ctx)

    def model_info(self) -> dict[str, Any]:
        return _model_info(self._ctx)

    async def server_info(self) -> dict[str, Any]:
        return await _server_info(self._ctx)


async def _final_outputs(ctx: ServingContext, choices: list[Choice]) -> list[dict[str, Any]]:
    async def last(choice: Choice) -> dict[str, Any]:
        last_out: dict[str, Any] = {}
        async for out in ctx.manager.generate(choice.request, choice.prepared):
            last_out = out  # not streamed: the one and only output
        return last_out

    tasks = [asyncio.ensure_future(last(c)) for c in choices]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        # A failed or cancelled wait leaves the others running: cancelling them closes their
        # manager generators, which aborts them in the scheduler (their KV is freed).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _api_error(exc: BaseException) -> APIError:
    if isinstance(exc, EngineDeadError):
        return engine_dead_error(exc)
    if isinstance(exc, ServerShuttingDownError):
        return shutting_down_error(exc)
    assert isinstance(exc, RequestError)
    return from_request_error(exc)


async def start_frontends(ctx: ServingContext) -> list[tuple[str, RunningFrontend]]:
    """Starts every frontend whose flag is set, on the running loop; returns (name, handle) pairs.

    A frontend that fails to start stops those already started and raises (the server then exits).
    """
    started: list[tuple[str, RunningFrontend]] = []
    try:
        for name, port in enabled_frontends(ctx.args):
            start = frontend_entry_point(name).load()
            started.append((name, await start(NativeAPI(ctx), ctx.args.host, port)))
            logger.info("%s frontend serving on %s:%d", name, ctx.args.host, port)
    except BaseException:
        await stop_frontends(started, None)
        raise
    return started


async def stop_frontends(frontends: list[tuple[str, RunningFrontend]], grace_s: float | None) -> None:
    """Stops them all at once (each logs its own failure; shutdown goes on)."""
    async def stop(name: str, frontend: RunningFrontend) -> None:
        try:
            await frontend.stop(grace_s)
        except Exception:
            logger.exception("stopping the %s frontend failed", name)

    await asyncio.gather(*(stop(name, f) for name, f in frontends))


__all__ = ["APIError", "NativeAPI", "RunningFrontend", "start_frontends", "stop_frontends"]
