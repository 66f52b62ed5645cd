"""Starting the engine's child processes as fresh interpreters.

multiprocessing's ``spawn`` and ``forkserver`` re-import the parent's ``__main__`` module in the
child, so a user script without an ``if __name__ == "__main__":`` guard would build a second
``Engine`` inside the scheduler process and crash it. A child here is ``python -c`` running
``bootstrap()``, which reads what to call from a pipe: it never sees the user's main module.

The child gets the parent's ``sys.path`` (as multiprocessing does), its arguments pickled, and
may be handed the write end of a pipe (``InheritedConnection``) for the ready handshake.
"""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

# -P (3.11+): the child does not put its working directory first on sys.path, so a user's file
# named like one of our modules cannot shadow it before the parent's sys.path is installed.
_SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []
_BOOTSTRAP = "import sys; from engine.entrypoints.child_process import bootstrap; bootstrap(int(sys.argv[1]))"

@dataclass(frozen=True)
class InheritedConnection:
    """Stands in, among a child's arguments, for one end of a pipe the child inherits."""

    fd: int
    child_writes: bool = True  # False: the parent writes, the child reads


def pipe(to_child: bool = False) -> tuple[Connection, InheritedConnection]:
    """A one-way channel between this process (the ``Connection``) and one child (the other end).

    By default the child writes and the parent reads; ``to_child=True`` turns it around.
    """
    read_fd, write_fd = os.pipe()
    if to_child:
        return Connection(write_fd, readable=False), InheritedConnection(read_fd, child_writes=False)
    return Connection(read_fd, writable=False), InheritedConnection(write_fd)


class ChildProcess:
    """A child interpreter running ``target(*args)``, with ``multiprocessing.Process``'s methods.

    ``target`` is ``"package.module:function"``; the function must take picklable arguments.
    ``env``: variables set for the child on top of this process's environment (thread pools'
    sizes, ``engine.cpu_threads``).
    """

    def __init__(self, target: str, args: tuple[Any, ...], name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        inherited = [a.fd for a in args if isinstance(a, InheritedConnection)]
        payload_read, payload_write = os.pipe()
        try:
            self._popen = subprocess.Popen(
                [sys.executable, *_SAFE_PATH, "-c", _BOOTSTRAP, str(payload_read)],
                stdin=subprocess.DEVNULL, pass_fds=(payload_read, *inherited), close_fds=True,
                env={**os.environ, **env} if env else None)
        finally:
            os.close(payload_read)
            for fd in inherited:
                os.close(fd)  # the child holds its own copy; ours would hide its exit from the reader
        # Small payloads (ServerArgs and names) fit the pipe's buffer: this does not wait for the child.
        with os.fdopen(payload_write, "wb") as f:
            pickle.dump(list(sys.path), f)
            pickle.dump((target, args), f)
        self.pid = self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while running; negative signal number when killed by a signal (as multiprocessing)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


#: Allocations between young-generation collections in the engine's own processes (Python's default
#: is 700). Start-up builds hundreds of thousands of long-lived objects (torch, transformers, the
#: model), and at 700 the collector walks that growing heap again and again: 0.6 s of the
#: scheduler's 6.6 s and of the CLI's 4.2 s starting the default model. At 10,000: 0.9 s less CPU
#: per `engine generate` (9.8 -> 8.9 s, 3 processes), at most that many young objects in cycles
#: waiting a little longer to be freed.
GC_GEN0_THRESHOLD = 10_000


def tune_gc() -> None:
    """Sets ``GC_GEN0_THRESHOLD`` (the older generations' thresholds stay): for a process of the
    engine's own (the CLI, the scheduler and detokenizer children), not a user's script."""
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


def bootstrap(payload_fd: int) -> None:
    """The child's side: read sys.path and the call from the parent, then run it."""
    tune_gc()
    with os.fdopen(payload_fd, "rb") as f:
        sys.path[:] = pickle.load(f)
        target, args = pickle.load(f)
    module_name, _, func_name = target.partition(":")
    import importlib

    func = getattr(importlib.import_module(module_name), func_name)
    args = tuple(Connection(a.fd, readable=not a.child_writes, writable=a.child_writes)
                 if isinstance(a, InheritedConnection) else a for a in args)
    func(*args)
