"""The HTTP server: the FastAPI app (OpenAI and native routes) and ``run_server`` (uvicorn).

``serve`` (``engine.entrypoints.serve_start``) binds the port first (a busy
port fails in a second, not after loading the model), starts the scheduler and detokenizer
processes, imports this module while they load, then ``run_server`` runs uvicorn with the
tokenizer manager on its event loop. It returns the process exit code: 0 after SIGTERM/SIGINT,
1 when an engine process died.

Shutdown drains: the listening socket closes (after accepting the connections already
waiting) and ``/health`` answers 503 (load balancers stop sending); every request received
before the drain began, whether generating, queued, being tokenized or still being read
(``engine.managers.arrivals``), gets ``--shutdown-grace-s`` to finish; requests that arrive
later get a 503. After the grace period the rest end with a 503 body or, for streams, an
error event and ``[DONE]``; only then does uvicorn close the connections, so no handler is
cancelled mid-response. The engine processes ignore a SIGTERM sent to the whole process group
(systemd, Docker, Kubernetes) and stop when this process tells them, afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from engine.version import __version__
from engine.entrypoints.frontend import RunningFrontend, start_frontends, stop_frontends
from engine.entrypoints.http.context import ServingContext, served_model_name
from engine.entrypoints.http.dashboard import router as dashboard_router
from engine.entrypoints.http.errors import install_error_handlers
from engine.entrypoints.http.guards import FrontDoor
from engine.entrypoints.http.live_view import LiveView
from engine.entrypoints.http.native import router as native_router
from engine.entrypoints.http.routes import router as openai_router
from engine.entrypoints.startup import Signals, StartupInterrupted, bind_socket, server_url
from engine.managers.arrivals import Arrivals
from engine.managers.tokenizer_manager import TokenizerManager
from engine.metrics import ServerMetrics

if TYPE_CHECKING:
    from engine.config import ServerArgs
    from engine.entrypoints.launch import Runtime

logger = logging.getLogger("engine.server")

# After an engine process died: time for pending requests to receive their 500s.
_FATAL_DRAIN_S = 0.5
# After the grace period every request has its answer; this bounds writing it to slow clients.
_FLUSH_S = 5
# Event-loop turns that accept the listen backlog, then read requests already sent, at shutdown.
_SETTLE_TURNS = 3


def create_app(runtime: Runtime, tokenizer: Any | None, *, on_fatal: Callable[[str], None] | None = None,
               max_body_bytes: int | None = None,
               manager_factory: Callable[..., Any] = TokenizerManager) -> FastAPI:
    """The ASGI app. The tokenizer manager is created in the lifespan, on the serving loop.

    Args:
        runtime: the started scheduler and detokenizer processes (``launch_runtime``).
        tokenizer: the loaded tokenizer, or None with ``--skip-tokenizer-init``.
        on_fatal: called with the reason when an engine process dies (the server then exits).
        max_body_bytes: larger request bodies are refused with 413 (default: ``--max-body-bytes``).
        manager_factory: builds the tokenizer manager (tests pass a fake).
    """
    args = runtime.args
    arrivals = Arrivals()  # the front door records arrivals, the manager's drain reads them

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        manager = manager_factory(args, runtime.model_path, runtime.ipc, runtime.ready, runtime.processes, tokenizer)
        manager.arrivals = arrivals
        manager.start()
        ctx = ServingContext(args=args, manager=manager, ready=runtime.ready, model_path=runtime.model_path,
                             model_name=served_model_name(args, runtime.model_path), tokenizer=tokenizer)
        ctx.metrics = ServerMetrics(ctx.model_name, getattr(args, "metrics_compat", "none"), runtime.ready.context_len)
        manager.on_finish.append(ctx.metrics.observe_finished)
        manager.on_route.append(ctx.metrics.observe_route)
        if not getattr(args, "disable_dashboard", False):
            ctx.live_view = LiveView()
            manager.on_finish.append(ctx.live_view.observe_finished)
        tracer = None
        if getattr(args, "otlp_traces_endpoint", None):
            from engine.entrypoints.tracing import RequestTracer  # the SDK is imported only when on

            tracer = RequestTracer(args.otlp_traces_endpoint, ctx.model_name)
            manager.on_finish.append(tracer.observe_finished)
        app.state.ctx = ctx
        watcher = asyncio.ensure_future(_watch_engine(manager, on_fatal))
        try:
            yield
        finally:
            watcher.cancel()
            logger.info("stopping the tokenizer manager")
            await manager.close()
            if tracer is not None:
                tracer.shutdown()  # exports the spans still queued

    app = FastAPI(title="engine", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible and SGLang-native APIs; see docs/api.md")
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(native_router)
    if not getattr(args, "disable_dashboard", False):
        app.include_router(dashboard_router)
    app.add_middleware(FrontDoor, api_key=args.api_key, arrivals=arrivals, allowed_origins=args.allowed_origins,
                       max_body_bytes=args.max_body_bytes if max_body_bytes is None else max_body_bytes)
    return app


async def _watch_engine(manager: Any, on_fatal: Callable[[str], None] | None) -> None:
    """Ends the server shortly after an engine process died (the manager fails pending requests)."""
    while manager.dead is None:
        await asyncio.sleep(0.25)
    logger.error("%s; the server exits", manager.dead)
    await asyncio.sleep(_FATAL_DRAIN_S)
    if on_fatal is not None:
        on_fatal(manager.dead)


# -- running it ----------------------------------------------------------------------------
def ready_line(ctx: ServingContext, url: str) -> str:
    """The one start-up line: where, what model, which plugins, attention backend and platform."""
    ready = ctx.ready
    plugins = ", ".join(p["name"] for p in ready.plugins if p.get("status") == "ok") or "none"
    dp = ctx.args.dp_size
    replicas = f"{dp} data-parallel replicas, router {ctx.args.router_policy}, each " if dp > 1 else ""
    return (f"engine {__version__} serving '{ctx.model_name}' on {url} | model {ctx.model_path} | "
            f"attention {ready.attention_backend}, platform {ready.platform} ({ready.device}, {ready.dtype}), "
            f"{replicas}KV pool {ready.max_total_num_tokens} tokens, context {ready.context_len} | plugins: {plugins}")


def run_server(args: ServerArgs, runtime: Runtime, sock: socket.socket, signals: Signals, started: float) -> int:
    """Serves on ``sock`` (bound, not yet listening) with the loaded ``runtime`` until SIGTERM/SIGINT
    (returns 0) or an engine process dies (returns 1); ``serve_start.serve`` calls it once the
    model is loaded, ``started`` being when its start-up began (``time.perf_counter()``)."""
    url = server_url(args.host, args.port)
    exit_code = 0
    try:
        ready = runtime.ready
        logger.info("model loaded in %.1f s: KV pool %d tokens, context %d, %d request slots",
                    time.perf_counter() - started, ready.max_total_num_tokens, ready.context_len,
                    ready.max_running_requests)
        tokenizer = runtime.tokenizer  # loaded while the model loaded (None with --skip-tokenizer-init)

        def on_fatal(reason: str) -> None:
            nonlocal exit_code
            if server.should_exit:
                # Already stopping: a signal sent to the whole process group (Ctrl-C, systemd,
                # `timeout`) also reaches the children, whose exit is then expected.
                return
            exit_code = 1
            server.config.timeout_graceful_shutdown = 1  # pending requests have already failed
            server.should_exit = True

        app = create_app(runtime, tokenizer, on_fatal=on_fatal)
        verbose = args.log_level == "debug"
        config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                                timeout_graceful_shutdown=_FLUSH_S, lifespan="on")
        server = _Server(config, lambda: ready_line(app.state.ctx, url), app, args.shutdown_grace_s, on_fatal)
        signals.server = server
        server.run(sockets=[sock])
    except StartupInterrupted:
        logger.info("interrupted during start-up")
    finally:
        logger.info("shutting down the engine processes")
        runtime.shutdown()
        sock.close()
    return exit_code


async def _loop_turns(turns: int) -> None:
    """Lets the event loop poll its sockets ``turns`` times (accepts, reads, request tasks' first steps)."""
    for _ in range(turns):
        await asyncio.sleep(0.005)


class _Server(uvicorn.Server):
    """uvicorn's Server, starting the frontends beside HTTP (``--grpc-port``) and printing the
    ready line once it accepts connections, and draining the tokenizer manager's requests (theirs
    too) before uvicorn's own shutdown closes connections."""

    def __init__(self, config: uvicorn.Config, line: Callable[[], str], app: FastAPI, grace_s: float,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        super().__init__(config)
        self._line = line
        self._app = app
        self._grace_s = grace_s
        self._on_fatal = on_fatal
        self._frontends: list[tuple[str, RunningFrontend]] = []

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        ctx = getattr(self._app.state, "ctx", None)
        if ctx is not None and ctx.manager.dead is None and not self.force_exit:
            # Connections waiting in the listen backlog arrived before the signal: accept them
            # before closing the socket (closing resets them). Then stop accepting (uvicorn does
            # it again below, harmlessly), and let the loop read what the accepted connections
            # already sent, so their requests arrive before the drain begins.
            await _loop_turns(_SETTLE_TURNS)
            for server in self.servers:
                server.close()
            for sock in sockets or []:
                sock.close()
            # The frontends stop taking calls too; theirs in flight drain with the HTTP requests
            # (a second more: calls ended at the deadline still write their error status).
            stopping = asyncio.ensure_future(stop_frontends(self._frontends, self._grace_s + 1))
            await _loop_turns(_SETTLE_TURNS)
            logger.info("shutting down: no new connections; %d request(s) received get up to %g s to finish",
                        ctx.manager.arrivals.open, self._grace_s)
            ended = await ctx.manager.drain(self._grace_s)
            if ended:
                # Give the handlers a moment to write the 503s and error events they now hold.
                await asyncio.sleep(0.1)
            await stopping
        else:
            await stop_frontends(self._frontends, None)
        self._frontends = []
        await super().shutdown(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        try:
            self._frontends = await start_frontends(self._app.state.ctx)
        except Exception as exc:  # a busy port, a broken plugin: the server exits with status 1
            logger.error("a frontend failed to start: %s: %s", type(exc).__name__, exc)
            if self._on_fatal is not None:
                self._on_fatal(f"a frontend failed to start: {exc}")
            return
        print(self._line(), flush=True)


# bind_socket and server_url live in startup (no torch); importable from here as before.
__all__ = ["bind_socket", "create_app", "ready_line", "run_server", "server_url"]
