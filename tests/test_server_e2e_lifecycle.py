"""End to end: start-up errors, SIGTERM shutdown and the death of an engine process."""

from __future__ import annotations

import importlib.util
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
def servers(tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Iterator[tuple[Server, Server]]:
    """Two private servers (each test ends one), started side by side; the first serves gRPC too
    where plugserve-grpc is installed, so its SIGTERM drains a gRPC stream with the HTTP one."""
    ckpt = llama_ckpt_dir
    logs = str(tmp_path_factory.mktemp("lifecycle-logs"))
    grpc_port = free_port() if importlib.util.find_spec("engine_grpc") else None
    first = launch(ckpt, logs, *(("--grpc-port", str(grpc_port)) if grpc_port else ()), api_key=None)
    if grpc_port:
        first.extra["grpc_port"] = grpc_port
    pair = (first, launch(ckpt, logs, api_key=None))
    try:
        for server in pair:
            server.wait_ready()
        yield pair
    finally:
        for server in pair:
            server.stop(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _engine_children(server: Server) -> list[int]:
    out = []
    for pid in server.descendants():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"engine.entrypoints.child_process" in f.read():  # how launch_runtime starts them
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


def test_sigterm_finishes_inflight_then_exits_cleanly(servers: tuple[Server, Server]) -> None:
    server = servers[0]
    children = server.descendants()
    assert len(_engine_children(server)) == 2, children
    result: dict[str, Any] = {}

    def stream() -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
                result["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)

    def grpc_stream() -> None:
        from engine_grpc.client import Client, collect

        with Client(f"127.0.0.1:{server.extra['grpc_port']}", timeout=60) as client:
            call = client.generate(input_ids=[5, 6, 7], stream=True,
                                   sampling_params={"max_new_tokens": 300, "ignore_eos": True})
            result["grpc"] = (collect(call), call.code())

    threads = []
    if "grpc_port" in server.extra:  # the longer one first, so that both are in flight at the signal
        threads.append(threading.Thread(target=grpc_stream))
        threads[-1].start()
        assert _wait_until_inflight(server), "the gRPC stream never started"
    threads.append(threading.Thread(target=stream))
    threads[-1].start()
    assert _wait_until_inflight(server, len(threads)), "the streamed requests never started"
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.log()[-3000:]
    for thread in threads:
        thread.join(30)
    events = result.get("events")
    assert events, (result, server.log()[-3000:])
    assert events[-1] == "data: [DONE]" and '"finish_reason":{"type":"length"' in events[-2], events[-2:]
    if "grpc_port" in server.extra:  # the gRPC stream drained to its end too
        (output,), code = result["grpc"]
        assert (code.name, output.finish_reason, len(output.token_ids)) == ("OK", "length", 300), result["grpc"]
    # multiprocessing's resource tracker leaves a moment after its parent: allow it that moment.
    deadline = time.monotonic() + 5.0
    while [pid for pid in children if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in children if _alive(pid)], "processes left behind after SIGTERM"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)


def _wait_until_inflight(server: Server, count: int = 1, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/get_server_info", timeout=10).json()["num_inflight_reqs"] >= count:
            return True
        time.sleep(0.01)
    return False


def test_engine_process_death_fails_requests_and_exits(servers: tuple[Server, Server]) -> None:
    server = servers[1]
    children = server.descendants()
    result: dict[str, Any] = {}

    def long_request() -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
        result["r"] = httpx.post(server.url + "/generate", json=body, timeout=60)

    thread = threading.Thread(target=long_request)
    thread.start()
    assert _wait_until_inflight(server), "the request never started"
    os.kill(_engine_children(server)[0], signal.SIGKILL)
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
