"""Starting ``engine serve`` as a subprocess for the end-to-end tests (this module holds no tests).

The e2e modules import it by path (``sys.path`` gets this directory); one server
on the session's tiny checkpoint (``llama_ckpt_dir`` from tests/conftest.py) is
shared by the whole session through ``config.stash`` and stopped at the end
with ``config.add_cleanup``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from engine.ports import free_port  # the e2e modules import it from here too

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
_START_TIMEOUT_S = 180.0
_SERVER_KEY = pytest.StashKey["Server"]()
_DEFAULT_SERVER_KEY = pytest.StashKey["Server"]()


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: str
    api_key: str | None = API_KEY
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=30, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        kw.setdefault("headers", self.headers)
        return httpx.post(self.url + path, timeout=60, **kw)

    def descendants(self) -> list[int]:
        """Pids of every process below the server (Linux /proc)."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except FileNotFoundError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        kids = [int(k) for k in f.read().split()]
                except FileNotFoundError:
                    kids = []
                out.extend(kids)
                todo.extend(kids)
        return out

    def engine_children(self) -> list[int]:
        """Pids of the server's engine processes (scheduler, detokenizer): its direct children
        started through engine.entrypoints.child_process, or forked from it (same command line),
        not helpers such as multiprocessing's resource tracker."""
        def cmdline(pid: int) -> bytes:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read()

        own, out = cmdline(self.proc.pid), []
        for pid in self.descendants():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                line = cmdline(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue
            if parent == self.proc.pid and (b"engine.entrypoints.child_process" in line or line == own):
                out.append(pid)
        return out

    def wait_ready(self, timeout: float = _START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"engine serve did not become healthy in {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def launch(model_path: str, log_dir: str, *args: str, api_key: str | None = API_KEY,
           new_session: bool = False) -> Server:
    """Starts ``engine serve`` on a free 127.0.0.1 port (does not wait for it).

    ``new_session`` gives the server its own process group, which a test may then signal
    as a whole, as systemd, Docker and Kubernetes do.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--model-path", model_path, "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", MODEL_NAME, "--max-total-tokens", "32768", *args]
    if api_key:
        cmd += ["--api-key", api_key]
    log_path = os.path.join(log_dir, f"server-{port}.log")
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes to it for its whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=new_session)
    log.close()
    return Server(proc, port, log_path, api_key)


@contextmanager
def running(*servers: Server, stop_signal: int = signal.SIGTERM) -> Iterator[None]:
    """Waits until every one of ``servers`` (launched already, so they start side by side) answers
    /health, and stops them all with ``stop_signal`` when the block ends, however it ends."""
    try:
        for server in servers:
            server.wait_ready()
        yield
    finally:
        for server in servers:
            server.stop(stop_signal)


def shared_server(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Server:
    """The session's shared server on ``model_path``, started on first use and stopped when pytest ends.
    With plugserve-grpc installed it serves gRPC too, on ``extra["grpc_port"]``
    (tests/test_server_e2e_grpc.py), which costs no second start."""
    if _SERVER_KEY not in config.stash:
        grpc = ("--grpc-port", str(free_port())) if importlib.util.find_spec("engine_grpc") else ()
        server = launch(model_path, str(tmp_path_factory.mktemp("e2e-logs")), *grpc)
        if grpc:
            server.extra["grpc_port"] = int(grpc[1])
        config.add_cleanup(server.stop)
        server.wait_ready()
        config.stash[_SERVER_KEY] = server
    return config.stash[_SERVER_KEY]


def shared_default_server(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """The session's shared ``engine serve`` on the embedded default model, as the docs start it
    (no --model-path, no API key, served as 'default'), started on first use and stopped when
    pytest ends. Every module that needs that server and no other flags uses this one: a start
    costs 10-15 s of CPU (under pytest-xdist, one per worker).
    """
    if _DEFAULT_SERVER_KEY not in config.stash:
        port = free_port()
        # With plugserve-grpc installed it serves gRPC too (docs/grpc.md's examples run on it).
        grpc = ("--grpc-port", str(free_port())) if importlib.util.find_spec("engine_grpc") else ()
        log_path = str(tmp_path_factory.mktemp("default-model-server") / "server.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1",
                                     "--port", str(port), "--max-total-tokens", "16384", *grpc],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        server = Server(proc, port, log_path, api_key=None)
        if grpc:
            server.extra["grpc_port"] = int(grpc[1])
        config.add_cleanup(server.stop)
        # A first start on a fresh $ENGINE_CACHE_DIR also converts the default model's GGUF.
        server.wait_ready(timeout=600)
        config.stash[_DEFAULT_SERVER_KEY] = server
    server = config.stash[_DEFAULT_SERVER_KEY]
    if server.proc.poll() is not None:
        raise RuntimeError(f"the shared default-model server exited with {server.proc.returncode}:\n"
                           f"{server.log()[-4000:]}")
    return server


def server_info(server: Server) -> dict[str, Any]:
    r = server.get("/get_server_info")
    r.raise_for_status()
    return r.json()


def wait_idle(server: Server, timeout: float = 20.0) -> dict[str, Any]:
    """Polls /get_server_info until nothing runs and no KV is held by requests (bounded)."""
    deadline = time.monotonic() + timeout
    info = server_info(server)
    while time.monotonic() < deadline:
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_used_tokens"] == 0:
            return info
        time.sleep(0.2)
        info = server_info(server)
    return info


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Polls ``predicate`` until it holds or ``timeout`` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def inflight(server: Server) -> int:
    """The server's requests in flight (``num_inflight_reqs`` of /get_server_info)."""
    return int(httpx.get(server.url + "/get_server_info", timeout=30).json()["num_inflight_reqs"])


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (Linux /proc); a zombie has exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_no_kv_leak(info: dict[str, Any]) -> None:
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0, info
    assert info["kv_used_tokens"] == 0, info
    assert info["kv_free_tokens"] + info["kv_evictable_tokens"] == info["max_total_num_tokens"], info
