"""A warm interpreter for the manual's python blocks (tests/test_docs_examples.py; this module holds
no tests).

Most python blocks of the manual import the engine, torch or transformers before they do anything,
a few CPU-seconds each in a fresh ``python3``. This module, run as a script, imports those once
and then forks one child per block: the child runs the block's file as ``python3 FILE`` would
(``__main__``, ``sys.argv``, ``sys.path[0]`` the page's directory, the block's environment, stdin
from /dev/null, stdout and stderr to one file, its own session, exit status from ``SystemExit`` or
1 with the traceback on an exception, atexit handlers run). Only imports happen before the fork:
nothing has computed, so no thread pool exists that a child could inherit half-built.

Protocol, one JSON object a line on a socket (fd given as argv[1]): the test sends
``{"script", "cwd", "env", "output"}``, the runner answers ``{"pid"}`` once the child runs and
``{"status"}`` when it has exited (a negative status: killed by that signal).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# What the blocks import most, costly to import: the engine's offline API and its test kit,
# torch, transformers' model classes, the OpenAI client.
WARM_IMPORTS = ("torch", "numpy", "transformers", "transformers.modeling_utils", "openai", "httpx", "engine",
                "engine.entrypoints.engine", "engine.testing.checkpoints", "engine.testing.harness")


def _pth_files() -> set[tuple[str, str]]:
    import site

    return {(d, name) for d in site.getsitepackages() if os.path.isdir(d) for name in os.listdir(d)
            if name.endswith(".pth")}


def _child(request: dict[str, Any]) -> None:
    """In the forked child: becomes ``python3 SCRIPT`` in the block's directory, then exits."""
    import atexit
    import importlib
    import runpy
    import site
    import threading
    import traceback

    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(devnull)
    # Unbuffered as PYTHONUNBUFFERED=1 (the blocks' environment) makes a fresh interpreter.
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # Distributions a block installed since the runner started (a .pth file each) are seen.
    for directory, name in sorted(_pth_files() - request["pth_at_start"]):
        site.addpackage(directory, name, set())  # type: ignore[attr-defined]
    importlib.invalidate_caches()
    script = request["script"]
    sys.argv = [script]
    sys.path[0] = request["cwd"]
    code: Any = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - reported as python3 would
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as at exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def serve(fd: int) -> None:
    """The runner's loop: one block at a time, until the socket closes."""
    for name in WARM_IMPORTS:
        try:
            __import__(name)
        except ImportError:
            pass
    pth_at_start = _pth_files()
    conn = socket.socket(fileno=fd)
    reader = conn.makefile("r", encoding="utf-8")
    for line in reader:
        request = {**json.loads(line), "pth_at_start": pth_at_start}
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        conn.sendall((json.dumps({"status": code}) + "\n").encode())


class WarmPython:
    """The test side: starts the runner on first use and runs a block's file in it."""

    def __init__(self, env: dict[str, str]) -> None:
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: socket.socket | None = None
        self._buffer = b""

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                      env=self._env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn, self._buffer = ours, b""

    def _reply(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The runner's next line, or None when ``timeout`` s pass first."""
        assert self._conn is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(65536)
            if not chunk:
                raise RuntimeError("the warm python runner exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, script: Path, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, bool]:
        """Runs ``script`` as ``python3 script`` in ``cwd``: (status, output, timed out)."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._conn is not None
        output = cwd / f"{script.name}.out"
        self._conn.sendall((json.dumps({"script": str(script), "cwd": str(cwd), "env": env,
                                        "output": str(output)}) + "\n").encode())
        pid = self._reply()["pid"]  # type: ignore[index]
        reply = self._reply(timeout)
        timed_out = reply is None
        if reply is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            reply = self._reply()
        status = reply["status"]  # type: ignore[index]
        # The block's own session may hold processes it started: killed, as run_block does.
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        text = output.read_text(errors="replace") if output.exists() else ""
        output.unlink(missing_ok=True)
        return status, text, timed_out

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            deadline = time.monotonic() + 10
            while self._proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
