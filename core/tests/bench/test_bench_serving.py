"""Tests for engine.bench.serving against a small SSE server started on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from engine.bench.datasets import BenchRequest
from engine.bench.serving import (
    BenchServingArgs,
    arrival_offsets,
    benchmark_serving,
    run_benchmark,
    run_requests,
)

MAX_TOKENS = 64  # bounds every streaming loop of the fake server
TOKEN_DELAY_S = 0.002


class FakeServer(ThreadingHTTPServer):
    """Streams ``" t<i>"`` per token. A prompt containing FAIL gets HTTP 500, ERRSTREAM an
    in-band error event after one token. Records payloads and peak concurrency."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.payloads: list[dict[str, Any]] = []
        self.send_usage = True  # False: OpenAI chunks carry no usage, the client must count
        self.tokens_per_event = 1  # >1: /generate batches tokens into one SSE event
        self.ids_only = False  # /generate streams output_ids with empty text (--skip-tokenizer-init)
        self.active = 0
        self.peak_active = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass

    def _send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _event(self, body: Any) -> None:
        self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
        self.wfile.flush()

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [{"id": "fake-model"}]})
        else:
            self._send_json(404, {"error": "not found"})

    def do_POST(self) -> None:
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.payloads.append(payload)
            self.server.active += 1
            self.server.peak_active = max(self.server.peak_active, self.server.active)
        try:
            self._answer(payload)
        finally:
            with self.server.lock:
                self.server.active -= 1

    def _answer(self, payload: dict[str, Any]) -> None:
        native = self.path == "/generate"
        if not native and self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._send_json(404, {"error": "not found"})
        prompt = payload.get("text") or payload.get("prompt") or json.dumps(payload.get("messages"))
        if "FAIL" in str(prompt):
            return self._send_json(500, {"error": "injected failure"})
        asked = payload["sampling_params"]["max_new_tokens"] if native else payload["max_tokens"]
        n = min(asked, MAX_TOKENS)
        pieces = [f" t{i}" for i in range(n)]
        if not payload.get("stream"):
            text = "".join(pieces)
            if native:
                return self._send_json(200, {"text": text, "meta_info": {"completion_tokens": n}})
            usage = {"completion_tokens": n}
            return self._send_json(200, {"choices": [{"text": text}], "usage": usage})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, piece in enumerate(pieces):
            time.sleep(TOKEN_DELAY_S)
            if native and (i + 1) % self.server.tokens_per_event and i + 1 < n:
                continue
            if native:
                text = "" if self.server.ids_only else "".join(pieces[: i + 1])
                ids = list(range(i + 1))
                self._event({"text": text, "output_ids": ids, "meta_info": {"completion_tokens": i + 1}})
            elif self.path == "/v1/completions":
                self._event({"choices": [{"index": 0, "text": piece}]})
            else:
                self._event({"choices": [{"index": 0, "delta": {"content": piece}}]})
            if "ERRSTREAM" in str(prompt):
                self._event({"error": {"message": "boom"}})
                return
        wants_usage = payload.get("stream_options", {}).get("include_usage")
        if not native and self.server.send_usage and wants_usage:
            self._event({"choices": [], "usage": {"completion_tokens": n}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)


def _args(server: FakeServer, **overrides: Any) -> BenchServingArgs:
    fields: dict[str, Any] = dict(base_url=server.url, disable_tqdm=True, seed=0)
    fields.update(overrides)
    return BenchServingArgs(**fields)


def _requests(n: int, output_len: int = 5) -> list[BenchRequest]:
    return [BenchRequest(f"hello number {i}", 3, output_len) for i in range(n)]


@pytest.mark.parametrize("backend", ["engine", "openai", "openai-chat"])
def test_streaming_counts_and_timings(server: FakeServer, backend: str) -> None:
    args = _args(server, backend=backend)
    results, duration = asyncio.run(run_requests(args, _requests(6)))
    assert duration > 0 and len(results) == 6
    for r in results:
        assert r.success, r.error
        assert r.output_len == 5 and r.generated_text == " t0 t1 t2 t3 t4"
        assert 0 < r.ttft <= r.latency
        assert len(r.itl) == 4 and all(gap >= 0 for gap in r.itl)
    # One warmup request plus six measured ones.
    assert len(server.payloads) == 7
    if backend != "engine":  # detected from GET /v1/models
        assert {p["model"] for p in server.payloads} == {"fake-model"}


def test_multi_token_events_spread_their_gap_over_the_tokens(server: FakeServer) -> None:
    server.tokens_per_event = 2
    results, _ = asyncio.run(run_requests(_args(server), _requests(3, 6)))
    for r in results:
        assert r.success and r.output_len == 6
        # Events carry tokens 1-2, 3-4, 5-6: the first event is TTFT, the other two each
        # give two equal gaps.
        assert len(r.itl) == 4
        assert r.itl[0] == r.itl[1] and r.itl[2] == r.itl[3]


def test_token_id_streams_time_the_first_token_not_the_end(server: FakeServer) -> None:
    # A server without a tokenizer streams output_ids and empty text: TTFT and ITL must come
    # from the ids (it used to wait for text that never came, so TTFT equalled the latency).
    server.ids_only = True
    args = _args(server, skip_tokenizer_init=True, vocab_size=50)
    results, _ = asyncio.run(run_requests(args, _requests(3, 8)))
    for r in results:
        assert r.success and r.output_len == 8 and r.generated_text == ""
        assert len(r.itl) == 7 and all(gap > 0 for gap in r.itl)
        # Seven measured gaps come after the first token (the bug gave TTFT == latency). Their
        # length is not checked: on a busy machine the client may read several events at once.
        assert r.ttft < r.latency
        assert r.ttft + sum(r.itl) == pytest.approx(r.latency, abs=0.05)


def test_payloads_follow_each_api(server: FakeServer) -> None:
    asyncio.run(run_requests(_args(server, backend="engine", warmup_requests=0), _requests(1, 7)))
    native = server.payloads[-1]
    assert native["text"] == "hello number 0" and native["stream"] is True
    sampling = {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}
    assert native["sampling_params"] == sampling
    args = _args(server, backend="openai", model="m", warmup_requests=0)
    asyncio.run(run_requests(args, _requests(1, 7)))
    oai = server.payloads[-1]
    got = (oai["model"], oai["prompt"], oai["max_tokens"], oai["ignore_eos"])
    assert got == ("m", "hello number 0", 7, True)
    assert oai["stream_options"] == {"include_usage": True}
    args = _args(
        server, backend="openai-chat", model="m", warmup_requests=0, disable_ignore_eos=True,
        extra_request_body={"top_p": 0.5},
    )  # fmt: skip
    asyncio.run(run_requests(args, _requests(1, 7)))
    chat = server.payloads[-1]
    assert chat["messages"] == [{"role": "user", "content": "hello number 0"}]
    assert (chat["ignore_eos"], chat["top_p"]) == (False, 0.5)


def test_model_is_detected_and_ids_prompts_are_sent(server: FakeServer, tmp_path: Path) -> None:
    result_file = tmp_path / "results.jsonl"
    args = _args(
        server, backend="openai", skip_tokenizer_init=True, vocab_size=50, num_prompts=8,
        random_input_len=6, random_output_len=4, random_range_ratio=1.0,
        result_file=str(result_file),
    )  # fmt: skip
    metrics = benchmark_serving(args)
    assert (metrics.completed, metrics.failed) == (8, 0)
    assert (metrics.total_input_tokens, metrics.total_output_tokens) == (48, 32)
    assert all(p["model"] == "fake-model" and len(p["prompt"]) == 6 for p in server.payloads)
    benchmark_serving(args)  # a second run appends a second line
    lines = result_file.read_text().splitlines()
    assert len(lines) == 2
    record = json.loads(lines[0])
    got = (record["completed"], record["dataset_name"], record["request_rate"])
    assert got == (8, "random", "inf")
    assert record["bench"] == "serving" and record["command"] and record["date"]  # for engine bench report


def test_output_len_falls_back_to_tokenizer_then_chunks(
    server: FakeServer, word_tokenizer: Any
) -> None:
    server.send_usage = False
    args = _args(server, backend="openai", model="m")
    results, _ = asyncio.run(run_requests(args, _requests(2, 6)))
    assert [r.output_len for r in results] == [6, 6]  # one chunk per token
    # The word tokenizer counts " t0 ... t5" as six words.
    results, _ = asyncio.run(run_requests(args, _requests(2, 6), tokenizer=word_tokenizer))
    assert [r.output_len for r in results] == [6, 6]


def test_failures_are_recorded_not_raised(server: FakeServer) -> None:
    requests = _requests(5)
    requests[2] = BenchRequest(prompt="please FAIL", prompt_len=2, output_len=5)
    requests[3] = BenchRequest(prompt="ERRSTREAM", prompt_len=1, output_len=5)
    results, _ = asyncio.run(run_requests(_args(server), requests))
    assert [r.success for r in results] == [True, True, False, False, True]
    assert results[2].error.startswith("HTTP 500") and "injected failure" in results[2].error
    assert "boom" in results[3].error
    metrics = asyncio.run(run_benchmark(_args(server), requests))
    assert (metrics.completed, metrics.failed, metrics.total_input_tokens) == (3, 2, 9)


def test_unreachable_server(unused_port: int) -> None:
    args = BenchServingArgs(port=unused_port, disable_tqdm=True, warmup_requests=0)
    results, _ = asyncio.run(run_requests(args, _requests(3)))
    assert not any(r.success for r in results) and all(r.error for r in results)
    with pytest.raises(RuntimeError, match="warmup"):
        args = BenchServingArgs(port=unused_port, disable_tqdm=True)
        asyncio.run(run_requests(args, _requests(3)))


@pytest.fixture
def unused_port() -> int:
    """A port nothing listens on: bound once, then released."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = srv.server_address[1]
    srv.server_close()
    return port


def test_request_rate_paces_arrivals(server: FakeServer) -> None:
    n, rate = 10, 20.0
    expected_last = arrival_offsets(n, rate, seed=0)[-1]
    args = _args(server, request_rate=rate, warmup_requests=0)
    paced, _ = asyncio.run(run_requests(args, _requests(n, 2)))
    span = max(r.start_time for r in paced) - min(r.start_time for r in paced)
    assert 0.8 * expected_last <= span <= expected_last + 2.0
    burst, _ = asyncio.run(run_requests(_args(server, warmup_requests=0), _requests(n, 2)))
    assert max(r.start_time for r in burst) - min(r.start_time for r in burst) < 0.5 * expected_last


def test_arrival_offsets_are_poisson_and_seeded() -> None:
    offsets = arrival_offsets(4001, 50.0, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 4000 == pytest.approx(1 / 50.0, rel=0.1)  # mean gap is 1 / rate
    assert offsets == arrival_offsets(4001, 50.0, seed=3) != arrival_offsets(4001, 50.0, seed=4)
    assert arrival_offsets(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_max_concurrency_caps_requests_in_flight(server: FakeServer) -> None:
    args = _args(server, max_concurrency=2, warmup_requests=0)
    results, _ = asyncio.run(run_requests(args, _requests(6, 8)))
    assert all(r.success for r in results)
    assert server.peak_active <= 2


def test_non_streaming_ttft_equals_latency(server: FakeServer) -> None:
    results, _ = asyncio.run(run_requests(_args(server, disable_stream=True), _requests(2, 4)))
    for r in results:
        assert r.success and r.output_len == 4 and r.itl == []
        assert r.ttft == pytest.approx(r.latency, abs=0.05)


def test_args_validation() -> None:
    with pytest.raises(ValueError, match="accepted: engine, sglang, openai, vllm, openai-chat"):
        BenchServingArgs(backend="trt")
    with pytest.raises(ValueError, match="--request-rate"):
        BenchServingArgs(request_rate=0)
    with pytest.raises(ValueError, match="--max-concurrency"):
        BenchServingArgs(max_concurrency=0)
    assert BenchServingArgs(backend="vllm").server_url() == "http://127.0.0.1:8000"
    assert BenchServingArgs(base_url="http://h:1/").server_url() == "http://h:1"


def test_client_processes_split_the_requests_and_keep_one_clock(server: FakeServer) -> None:
    # Three spawned senders: every request is answered once, results come back in request order,
    # and the paced arrivals (one clock for all processes) keep their span.
    n, rate = 9, 30.0
    expected_last = arrival_offsets(n, rate, seed=0)[-1]
    run: dict[str, Any] = {}
    requests = [BenchRequest(f"hello number {i}", 3, 2 + i % 3) for i in range(n)]
    args = _args(server, request_rate=rate, warmup_requests=0, client_processes=3)
    results, duration = asyncio.run(run_requests(args, requests, run=run))
    assert [r.output_len for r in results] == [2 + i % 3 for i in range(n)] and all(r.success for r in results)
    assert sorted(p["text"] for p in server.payloads) == sorted(r.prompt for r in requests)
    span = max(r.start_time for r in results) - min(r.start_time for r in results)
    assert 0.8 * expected_last <= span <= expected_last + 2.0
    assert duration >= max(r.start_time + r.latency for r in results) - min(r.start_time for r in results) - 0.25
    assert len(run["client_cpu_s_by_process"]) == 4  # the parent and three senders
    with pytest.raises(ValueError, match="--client-processes 2: not with --max-concurrency"):
        BenchServingArgs(client_processes=2, max_concurrency=4)
    with pytest.raises(ValueError, match="--client-processes must be >= 1"):
        BenchServingArgs(client_processes=0)
