"""Free local TCP ports, in a module of its own.

The rendezvous of a replica's ranks (``engine.distributed.ranks``), the servers a benchmark
starts (``engine.bench.startup``) and the conformance kits and tests all ask for one. It sits at
the bottom of the import graph and imports nothing but ``socket``, so callers that must not import
torch (the ``engine bench`` commands, load generators) can use it.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; nothing holds it after this returns, so a
    caller binds it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


__all__ = ["free_port"]
