"""``engine serve``'s start-up, up to the model being loaded, without importing the HTTP server.

The scheduler process's imports and model load are the longest part of a start. They begin as
soon as the port is bound and the checkpoint is resolved; this process imports the HTTP server
(FastAPI, uvicorn, torch: seconds) and loads the tokenizer while the scheduler works, then runs
the server (``http_server.run_server``). Nothing here imports torch, except on a CPU-only torch,
where the children are forks of this process and share its torch and transformers imports
(``child_process.allow_forked_children``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engine.entrypoints.startup import Signals, StartupInterrupted, bind_socket

if TYPE_CHECKING:
    from engine.config import ServerArgs
    from engine.entrypoints.launch import StartingRuntime

logger = logging.getLogger("engine.server")


def serve(args: ServerArgs) -> int:
    """Runs the server until SIGTERM/SIGINT (returns 0) or an engine process dies (returns 1)."""
    from engine.entrypoints.launch import resolve_model_path, start_runtime
    from engine.managers.process_utils import setup_child_logging

    if args.node_rank > 0:  # multi-node: the other nodes run only their ranks
        from engine.entrypoints.worker_node import serve_worker_node

        return serve_worker_node(args)
    setup_child_logging(args.log_level, "server")
    signals = Signals()
    signals.install()
    sock = bind_socket(args.host, args.port)
    if args.grpc_port:
        # gRPC binds once the model is loaded; a busy port fails now instead.
        bind_socket(args.host, args.grpc_port, "--grpc-port").close()
    starting: StartingRuntime | None = None
    try:
        started = time.perf_counter()
        from engine.entrypoints.child_process import allow_forked_children

        # With a CPU-only torch the children are forks of this process: it imports torch (and
        # transformers' config classes, in start_runtime) first, and they inherit them.
        allow_forked_children()
        # A GGUF (the default model is one) is converted on its first use, with a progress bar,
        # or found in the cache; either way the checkpoint's own log line says which.
        logger.info("[1/2] model: %s", args.model_path or "embedded default model (SmolLM2-135M-Instruct GGUF)")
        model_path = resolve_model_path(args)
        logger.info("[2/2] starting the scheduler and detokenizer processes; loading weights from %s and the tokenizer", model_path)
        starting = start_runtime(args, model_path)
        # While the scheduler imports and loads: the server's own imports, then the tokenizer.
        from engine.cpu_threads import limit_torch_threads
        from engine.entrypoints import http_server

        # This process runs the HTTP server and the tokenizer manager: one compute thread, so
        # torch (imported with the server) does not spread over the cores the scheduler uses.
        limit_torch_threads(1)
        runtime = starting.wait_ready()
    except StartupInterrupted:
        logger.info("interrupted during start-up")
        if starting is not None:
            starting.abort()  # no-op when wait_ready already stopped the children
        sock.close()
        return 0
    except BaseException:
        if starting is not None:
            starting.abort()
        sock.close()
        raise
    return http_server.run_server(args, runtime, sock, signals, started)


__all__ = ["serve"]
