"""What the server's start-up needs before the HTTP stack is imported: its signal handling, the
bound (not yet listening) socket and its URL. Shared by ``serve_start`` and ``http_server``;
nothing here imports torch or the web framework.
"""

from __future__ import annotations

import signal
import socket
from typing import Any

from engine.errors import ConfigError


class StartupInterrupted(BaseException):
    """SIGTERM/SIGINT while the model loads (BaseException: it must unwind the start-up)."""


class Signals:
    """SIGTERM/SIGINT handling outside uvicorn's own: abort the load, or stop the server."""

    def __init__(self) -> None:
        self.server: Any | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle)

    def handle(self, sig: int, frame: Any) -> None:
        if self.server is None:
            raise StartupInterrupted(sig)
        # uvicorn re-raises the signal it handled once it has shut down; by then nothing is left
        # to do. Before it installs its own handlers, this asks it to stop as soon as it runs.
        self.server.should_exit = True


def bind_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """Binds (without listening, so clients get 'connection refused' while the model loads);
    ``flag`` is the option the error names."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host: cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{flag}: cannot listen on {host}:{port}: {exc.strerror} "
                          f"(is another server running? pick another {flag})") from None
    return sock


def server_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


__all__ = ["Signals", "StartupInterrupted", "bind_socket", "server_url"]
