"""The gRPC server of ``engine serve --grpc-port N``: service ``plugserve.v1.Engine`` on the
HTTP server's event loop, over the engine's ``NativeAPI`` (the same tokenizer manager and the
same request code as the HTTP routes).

``start`` is the entry point ``grpc`` of the group ``engine.frontends``; the server calls it once
HTTP accepts connections. Each failed call ends with the gRPC status matching the HTTP status the
same request gets (400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 404 NOT_FOUND, 503 UNAVAILABLE, ...),
the message naming the field, and trailing metadata ``param`` (the field) and ``code`` (the
error's code, as in HTTP's error bodies) where they are known.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from engine.entrypoints.frontend import APIError
from engine_grpc import convert
from engine_grpc import plugserve_pb2 as pb
from engine_grpc import plugserve_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from engine.entrypoints.frontend import NativeAPI

logger = logging.getLogger("engine.grpc")

T = TypeVar("T")

# HTTP status -> gRPC status (the mapping gRPC's own HTTP gateway uses, plus 499 for a client
# that went away).
_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED, 500: grpc.StatusCode.INTERNAL, 501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_of(error: APIError) -> grpc.StatusCode:
    if error.code == "request_aborted":  # HTTP's 400, for a request ended by Abort
        return grpc.StatusCode.ABORTED
    return _STATUS.get(error.status, grpc.StatusCode.INVALID_ARGUMENT if error.status < 500 else grpc.StatusCode.INTERNAL)


class EngineService(pb_grpc.EngineServicer):
    """The service's methods, each one call of ``NativeAPI``."""

    def __init__(self, api: NativeAPI) -> None:
        self._api = api

    async def _run(self, context: grpc.aio.ServicerContext, work: Callable[[], Awaitable[T]],
                   authorize: bool = True) -> T:
        """Runs one call: the API key, the shutdown drain's bookkeeping, errors as statuses."""
        try:
            if authorize:
                metadata = {m.key: m.value for m in context.invocation_metadata() or ()}
                self._api.authorize(metadata.get("authorization"))
            with self._api.arrival():
                return await work()
        except APIError as exc:
            trailing = tuple((key, str(value)) for key, value in (("param", exc.param), ("code", exc.code)) if value)
            await context.abort(status_of(exc), exc.message, trailing_metadata=trailing)
            raise  # not reached: abort raises
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # a bug: say what, log the traceback
            logger.exception("gRPC call failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal server error: {type(exc).__name__}: {exc}")
            raise

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        async def work() -> None:
            builder = convert.ResponseBuilder()
            aborted: list[str] = []
            outputs = self._api.generate(convert.generate_body(request))
            try:
                async for out in outputs:
                    reason = out["meta_info"].get("finish_reason") or {}
                    if reason.get("type") == "abort":
                        aborted.append(str(reason.get("message") or "aborted"))
                    await context.write(builder.response(out))
            finally:
                # A cancelled call (the client went away) aborts the request here, at once.
                await outputs.aclose()
            if aborted:
                raise APIError(400, f"the request was aborted: {'; '.join(sorted(set(aborted)))}",
                               code="request_aborted")

        await self._run(context, work)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        async def work() -> pb.EmbedResponse:
            inputs, field = convert.embed_inputs(request)
            dimensions = request.dimensions if request.HasField("dimensions") else None
            results = await self._api.embed(inputs, dimensions, request.rid, field)
            return convert.embed_response(results)

        return await self._run(context, work)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        async def work() -> pb.AbortResponse:
            return pb.AbortResponse(aborted_rids=self._api.abort(request.rid))

        return await self._run(context, work)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        async def work() -> pb.HealthResponse:
            await self._api.health()
            return pb.HealthResponse(status="ok")

        # Load balancers probe health without credentials, as HTTP's /health.
        return await self._run(context, work, authorize=False)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        async def work() -> pb.ModelInfo:
            return convert.model_info(self._api.model_info())

        return await self._run(context, work)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        async def work() -> pb.ServerInfo:
            return convert.server_info(await self._api.server_info())

        return await self._run(context, work)


class GrpcFrontend:
    """The running server, as ``engine.entrypoints.frontend`` stops it."""

    def __init__(self, server: grpc.aio.Server, address: str) -> None:
        self.server = server
        self.address = address

    async def stop(self, grace_s: float | None) -> None:
        """No new calls from now on; calls in flight get ``grace_s`` seconds, then are cancelled."""
        await self.server.stop(grace_s)


async def start(api: NativeAPI, host: str, port: int, **options: Any) -> GrpcFrontend:
    """Serves ``plugserve.v1.Engine`` on ``host:port`` on the running event loop."""
    # Without SO_REUSEPORT a second server on the same port fails instead of sharing it.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *options.items()])
    pb_grpc.add_EngineServicer_to_server(EngineService(api), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"--grpc-port: cannot listen on {address}: {exc}") from None
    if not bound:
        raise RuntimeError(f"--grpc-port: cannot listen on {address}")
    await server.start()
    return GrpcFrontend(server, address)


__all__ = ["EngineService", "GrpcFrontend", "start", "status_of"]
