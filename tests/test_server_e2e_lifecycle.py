"""End to end: start-up errors and the death of an engine process. SIGTERM shutdown (draining HTTP
and gRPC streams, engine processes exiting with the server) is tested in
tests/test_server_e2e_availability.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import Server, free_port, launch  # noqa: E402

_CLI = [sys.executable, "-m", "engine"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Iterator[Server]:
    """A private server: its test kills one of its engine processes."""
    srv = launch(llama_ckpt_dir, str(tmp_path_factory.mktemp("lifecycle-logs")), api_key=None)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_until_inflight(server: Server, count: int = 1, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/get_server_info", timeout=10).json()["num_inflight_reqs"] >= count:
            return True
        time.sleep(0.01)
    return False


def test_engine_process_death_fails_requests_and_exits(server: Server) -> None:
    children = server.descendants()
    assert len(server.engine_children()) == 2, children  # the scheduler and the detokenizer
    result: dict[str, Any] = {}

    def long_request() -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
        result["r"] = httpx.post(server.url + "/generate", json=body, timeout=60)

    thread = threading.Thread(target=long_request)
    thread.start()
    assert _wait_until_inflight(server), "the request never started"
    os.kill(server.engine_children()[0], signal.SIGKILL)
    thread.join(30)
    r = result["r"]
    assert r.status_code == 500 and "died" in r.json()["error"]["message"], r.text
    started = time.monotonic()
    code = server.proc.wait(15)
    assert code != 0 and time.monotonic() - started < 5, (code, server.log()[-2000:])
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_CLI, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_port_in_use_fails_fast_with_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = _run_cli("serve", "--port", str(port))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: --port:") and "in use" in lines[-1], done.stderr


def test_unknown_plugin_fails_with_one_line(llama_ckpt_dir: str) -> None:
    done = _run_cli("serve", "--model-path", llama_ckpt_dir, "--port", str(free_port()), "--attention", "flashinfr")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: ") and "flashinfr" in done.stderr
