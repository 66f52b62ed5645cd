"""End to end: prefill/decode disaggregation on one machine (CPU, tiny checkpoint, zmq transfer).

One prefill server and one decode server (module-scoped, started side by side) behind the
router, which runs in this process (uvicorn in a thread: no engine). The decode server also
serves as the single-server reference: a request without a bootstrap room runs there whole.
The last tests kill the decode server and stop the prefill server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import API_KEY, Server, assert_no_kv_leak, free_port, launch, wait_idle  # noqa: E402

_GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
_HEADERS = {"Authorization": f"Bearer {API_KEY}"}
_TIMEOUT_S = 10.0  # the decode server's --disaggregation-timeout-s (a loaded CI machine prefills slowly)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Iterator[tuple[Server, Server]]:
    logs = str(tmp_path_factory.mktemp("disagg-logs"))
    prefill = launch(llama_ckpt_dir, logs, "--disaggregation-mode", "prefill",
                     "--disaggregation-bootstrap-port", str(free_port()), "--max-total-tokens", "4096")
    decode = launch(llama_ckpt_dir, logs, "--disaggregation-mode", "decode",
                    "--disaggregation-timeout-s", str(_TIMEOUT_S), "--max-total-tokens", "4096")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


@pytest.fixture(scope="module")
def router(servers: tuple[Server, Server]) -> Iterator[str]:
    import uvicorn

    from engine.disaggregation.router_app import create_app, discover

    prefill, decode = servers
    pd = discover([prefill.url], [decode.url], API_KEY, wait_s=30)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(pd), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=_HEADERS, timeout=60)


def _stream(url: str, path: str, body: dict[str, Any], timeout: float = 60) -> list[Any]:
    events = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=_HEADERS, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return events


def test_greedy_outputs_equal_a_single_server(servers: tuple[Server, Server], router: str) -> None:
    _, decode = servers
    prompts = [[7 + i, 20 + 3 * i, 5, 9 + i, 11] * (1 + i % 3) for i in range(6)]
    # One /generate batch through the router (the router names each prompt's request) ...
    batch = _post(router, "/generate", {"input_ids": prompts, "sampling_params": _GREEDY})
    assert batch.status_code == 200, batch.text
    # ... and single requests at once, each its own pair of halves.
    singles: list[Any] = [None] * 3

    def run(i: int) -> None:
        singles[i] = _post(router, "/generate", {"input_ids": prompts[i], "sampling_params": _GREEDY})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = [decode.post("/generate", json={"input_ids": p, "sampling_params": _GREEDY}).json()["output_ids"]
            for p in prompts]
    assert [out["output_ids"] for out in batch.json()] == want
    assert [s.json()["output_ids"] for s in singles] == want[:3]
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
            "temperature": 0}
    via_router = _post(router, "/v1/chat/completions", chat)
    assert via_router.status_code == 200, via_router.text
    alone = decode.post("/v1/chat/completions", json=chat).json()
    assert via_router.json()["choices"][0]["message"] == alone["choices"][0]["message"]
    assert via_router.json()["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    info = decode.get("/get_server_info").json()
    assert info["disaggregation"]["transferred"] >= 10 and info["disaggregation"]["failed"] == 0, info["disaggregation"]


def test_streaming_through_the_router(servers: tuple[Server, Server], router: str) -> None:
    _, decode = servers
    body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    # How many text chunks come is the server's timing: a reader that wakes late gets every token
    # ready by then in one chunk (on a busy machine all 12 at once). The usage chunk always follows
    # them, so the relay carries several events whatever the timing.
    events = _stream(router, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and len(events) >= 3, events
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 12, events[-2]
    streamed = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert streamed == decode.post("/v1/completions", json=body).json()["choices"][0]["text"]
    native = _stream(router, "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": _GREEDY})
    assert native[-1] == "[DONE]" and native[-2]["output_ids"] == decode.post(
        "/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": _GREEDY}).json()["output_ids"]


def test_a_refused_request_ends_at_once_and_kv_is_freed(servers: tuple[Server, Server], router: str) -> None:
    prefill, decode = servers
    # A request both halves refuse: the client gets the 400, not a hang.
    bad = _post(router, "/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}})
    assert bad.status_code == 400 and "temperature" in bad.text, bad.text
    # (KV that never comes times out with the reason: core/tests/disaggregation, in-process.)
    for server in (prefill, decode):
        server.post("/flush_cache")
        assert_no_kv_leak(wait_idle(server))
    assert decode.get("/get_server_info").json()["disaggregation"]["waiting_for_kv"] == 0


def test_killing_the_decode_server_fails_its_requests_within_seconds(servers: tuple[Server, Server],
                                                                    router: str) -> None:
    _, decode = servers
    body = {"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True},
            "stream": True}
    ended_with: list[Any] = []
    with httpx.stream("POST", router + "/generate", json=body, headers=_HEADERS, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "output_ids" in first
        decode.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for line in lines:
            if line.startswith("data: "):
                ended_with.append(line[6:])
        took = time.monotonic() - killed
    assert took < 10, f"the stream ran on {took:.1f} s after the decode server died"
    assert ended_with and "decode server" in ended_with[-1] and "error" in ended_with[-1], ended_with[-3:]
    started = time.monotonic()
    after = _post(router, "/generate", {"input_ids": [1, 2, 3], "sampling_params": _GREEDY})
    assert after.status_code == 502 and "decode server" in after.json()["error"]["message"], after.text
    assert time.monotonic() - started < 10


def test_stopping_the_prefill_server_closes_its_transfer_promptly(servers: tuple[Server, Server]) -> None:
    prefill, _ = servers
    port = prefill.get("/get_server_info").json()["disaggregation"]["backend"]["port"]
    started = time.monotonic()
    assert prefill.stop() == 0
    assert time.monotonic() - started < 15
    assert "KV transfer 'zmq' closed" in prefill.log(), prefill.log()[-2000:]
    with socket.socket() as sock:  # as zmq binds: TIME_WAIT of closed connections is no obstacle, a listener is
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
