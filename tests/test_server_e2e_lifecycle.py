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
from test_server_e2e_harness import Server, alive, free_port, inflight, launch, running, wait_for  # noqa: E402

_CLI = [sys.executable, "-m", "engine"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Iterator[Server]:
    """A private server: its test kills one of its engine processes."""
    srv = launch(llama_ckpt_dir, str(tmp_path_factory.mktemp("lifecycle-logs")), api_key=None)
    with running(srv, stop_signal=signal.SIGKILL):
        yield srv


def test_engine_process_death_fails_requests_and_exits(server: Server) -> None:
    children = server.descendants()
    assert len(server.engine_children()) == 2, children  # the scheduler and the detokenizer
    result: dict[str, Any] = {}

    def long_request() -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
        result["r"] = httpx.post(server.url + "/generate", json=body, timeout=60)

    thread = threading.Thread(target=long_request)
    thread.start()
    assert wait_for(lambda: inflight(server) >= 1, 20), "the request never started"
    os.kill(server.engine_children()[0], signal.SIGKILL)
    thread.join(30)
    r = result["r"]
    assert r.status_code == 500 and "died" in r.json()["error"]["message"], r.text
    started = time.monotonic()
    code = server.proc.wait(15)
    assert code != 0 and time.monotonic() - started < 5, (code, server.log()[-2000:])
    assert wait_for(lambda: not [pid for pid in children if alive(pid)], 5), "engine processes left behind"


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
