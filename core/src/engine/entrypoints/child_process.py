"""Starting the engine's child processes as fresh interpreters.

multiprocessing's ``spawn`` and ``forkserver`` re-import the parent's ``__main__`` module in the
child, so a user script without an ``if __name__ == "__main__":`` guard would build a second
``Engine`` inside the scheduler process and crash it. A child here is ``python -c`` running
``bootstrap()``, which reads what to call from a pipe: it never sees the user's main module.

The child gets the parent's ``sys.path`` (as multiprocessing does), its arguments pickled, and
may be handed the write end of a pipe (``InheritedConnection``) for the ready handshake.

``engine serve`` and ``engine generate`` fork their children instead (``allow_forked_children``)
where that is safe: their main process imports torch and transformers anyway, and a fresh
scheduler importing them again spent about 4.5 of its 6-8 CPU-seconds on the default model. Safe
means a CPU-only torch (no device runtime to inherit), no other Python thread in the parent, and
a parent that never computed on more than one thread (an OpenMP pool does not survive a fork).
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

# -P (3.11+): the child does not put its working directory first on sys.path, so a user's file
# named like one of our modules cannot shadow it before the parent's sys.path is installed.
_SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []
_BOOTSTRAP = "import sys; from engine.entrypoints.child_process import bootstrap; bootstrap(int(sys.argv[1]))"

logger = logging.getLogger(__name__)


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
        self._popen: Any = None
        self._status: int | None = None  # a forked child's exit code, once reaped
        inherited = [a.fd for a in args if isinstance(a, InheritedConnection)]
        if can_fork_children():
            self.pid = _fork(target, args, env or {}, inherited)
            for fd in inherited:
                os.close(fd)
            return
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
        if self._popen is not None:
            return self._popen.poll()
        if self._status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, its code unknown
                logger.warning("%s (pid %d) was reaped outside ChildProcess: its exit code is unknown, 255 stands in",
                               self.name, self.pid)
                self._status = 255
                return self._status
            if pid:
                self._status = os.waitstatus_to_exitcode(status)
        return self._status

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.is_alive():
            if self._popen is not None:
                self._popen.send_signal(sig)
            else:
                os.kill(self.pid, sig)

    def join(self, timeout: float | None = None) -> None:
        if self._popen is not None:
            try:
                self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)


_fork_allowed = False


def allow_forked_children() -> bool:
    """Lets this process fork its engine children (where ``can_fork_children`` still finds it safe
    when one starts); returns whether it does.

    Called by ``engine serve`` and ``engine generate``, whose main process only tokenizes and runs
    nothing of a user's (a script using ``Engine`` gets fresh interpreters: its threads, devices
    and state are not ours to copy). Only with a CPU-only torch: nothing of a device runtime can be
    inherited half-initialised. This imports torch and limits this process to one compute thread
    before it computes anything: a fork of a process whose OpenMP pool has run hangs at the
    child's first parallel operation (the pool's threads do not survive the fork). So a process
    that imported torch before this call (a test runner invoking the command) is refused.
    """
    global _fork_allowed
    if "torch" in sys.modules or not _cpu_only_torch():
        return False  # imported already: this process may have computed on several threads
    from engine.cpu_threads import limit_torch_threads

    limit_torch_threads(1)
    _fork_allowed = True
    return True


def forking_children() -> bool:
    """Whether ``allow_forked_children`` was granted in this process."""
    return _fork_allowed


def _cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only build, seen from its libraries (torch is not
    imported: on a GPU build the caller keeps its imports for later)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None or "torch_npu" in sys.modules:
        return False
    lib = os.path.join(os.path.dirname(spec.origin), "lib")
    return os.path.isdir(lib) and not any(os.path.exists(os.path.join(lib, f"libtorch_{name}.so"))
                                          for name in ("cuda", "hip", "xpu"))


def can_fork_children() -> bool:
    """Whether a child started now is a fork of this process (``allow_forked_children``): also no
    other Python thread running, and this process still on one compute thread."""
    if not _fork_allowed or threading.active_count() > 1:
        return False
    import torch

    return torch.get_num_threads() == 1 and not torch.backends.cuda.is_built()


def _fork(target: str, args: tuple[Any, ...], env: dict[str, str], keep_fds: list[int]) -> int:
    """Forks; the child runs ``target(*args)`` with ``env`` set and never returns here.

    The child keeps only stdio and ``keep_fds`` open, as ``close_fds`` does for a fresh one: a
    copy of another process's pipe end would hide that process's exit from its reader."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        # What a fresh interpreter would have: default signal handling (the parent's may raise
        # into its own start-up), no stdin, and the objects inherited from the parent left
        # out of this process's collections (walking them would copy their pages).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        low = 3
        for fd in sorted(keep_fds):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, os.sysconf("SC_OPEN_MAX"))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        gc.freeze()
        os.environ.update(env)
        import logging

        root = logging.getLogger()
        for handler in list(root.handlers):  # the parent's, with its name: the child sets its own
            root.removeHandler(handler)
        _run(target, args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise AssertionError("unreachable")  # os._exit does not return


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
    _run(target, args)


def _run(target: str, args: tuple[Any, ...]) -> None:
    module_name, _, func_name = target.partition(":")
    import importlib

    func = getattr(importlib.import_module(module_name), func_name)
    args = tuple(Connection(a.fd, readable=not a.child_writes, writable=a.child_writes)
                 if isinstance(a, InheritedConnection) else a for a in args)
    func(*args)
