"""The live view's routes and data in-process (no engine processes), the scheduler-side request
states, and request tracing into an in-process OTLP/HTTP collector. The page itself runs in a
real browser in tests/test_dashboard_browser.py."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine.config import ServerArgs
from engine.entrypoints.http.live_view import LiveView, percentile
from engine.errors import ConfigError
from engine.managers.io_struct import ControlReply
from engine.managers.request_state import ReqState
from engine.managers.timeline import MAX_STAGES, live_requests, mark

sys.path.insert(0, os.path.dirname(__file__))
from test_http_app import AUTH, KEY, ScriptedManager  # noqa: E402

INFO = {"max_total_num_tokens": 100, "kv_used_tokens": 30, "kv_usage": 0.3, "kv_evictable_tokens": 5,
        "num_running_reqs": 1, "num_waiting_reqs": 1, "extend_tokens": 0, "decode_rows": 0}


def _finished(rid: str, created: float, ttft: float, total: float, out: int = 5) -> ReqState:
    state = ReqState(rid, [1, 2, 3, 4])
    state.created, state.first_token_time, state.last_time = created, created + ttft, created + total
    state.output_ids = list(range(out))
    state.finished_reason = {"type": "length"}
    state.meta.update(prompt_tokens=4, completion_tokens=out, cached_tokens=1,
                      stages=[("queued", created + 0.001, 4), ("scheduled", created + 0.002, 0),
                              ("prefill_chunk", created + 0.002, 3)])
    return state


class LiveManager(ScriptedManager):
    """The scripted manager with the scheduler's ``requests`` reply: one in-flight request."""

    async def control(self, kind: str, timeout: float = 10.0) -> ControlReply:
        self.info_calls = getattr(self, "info_calls", 0) + 1
        return ControlReply(kind, 0, True, {**INFO, "extend_tokens": 40 * self.info_calls,
                                            "decode_rows": 10 * self.info_calls})

    async def control_replicas(self, kind: str, timeout: float = 10.0) -> list[ControlReply]:
        now = time.perf_counter()
        rows = [{"rid": rid, "state": "decoding", "prompt_tokens": 4, "output_tokens": 2, "cached_tokens": 0,
                 "retractions": 0, "stages": [("queued", now - 0.5, 4), ("scheduled", now - 0.4, 0),
                                              ("prefill_chunk", now - 0.4, 4)]} for rid in self.states]
        return [ControlReply(kind, 0, True, {"requests": rows, "decode_batch_size": len(rows)})]


def _make_app(tokenizer: Any, factory: Any, **server_args: Any) -> Any:
    from engine.entrypoints.http_server import create_app
    from engine.managers.io_struct import SchedulerReady

    ready = SchedulerReady(max_total_num_tokens=100, max_running_requests=8, context_len=64, vocab_size=2048,
                           device="cpu", attention_backend="torch_native", platform="cpu", dtype="float32",
                           eos_token_ids=[3], plugins=[])
    args = ServerArgs(model_path="/models/tiny", api_key=KEY, **server_args)
    runtime = SimpleNamespace(args=args, model_path="/models/tiny", ipc=None, ready=ready, processes=[])
    return create_app(runtime, tokenizer, manager_factory=factory)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tokenizer(llama_ckpt: str) -> Any:
    from engine.managers.tokenizer_utils import load_tokenizer

    return load_tokenizer(llama_ckpt)


@pytest.fixture(scope="module")
def client(tokenizer: Any) -> Any:
    with TestClient(_make_app(tokenizer, LiveManager)) as c:
        yield c


def test_page_loads_without_key_data_needs_it(client: TestClient) -> None:
    page = client.get("/dashboard")
    assert page.status_code == 200 and "uPlot.iife.min.js" in page.text
    js = client.get("/dashboard/static/uPlot.iife.min.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert client.get("/dashboard/static/uPlot.LICENSE").status_code == 200
    assert client.get("/dashboard/static/..%2Fdashboard.py").status_code in (401, 404)
    assert client.get("/dashboard/static/nothing.js").status_code == 404
    assert client.get("/dashboard/feed").status_code == 401
    assert client.get("/dashboard/requests/x").status_code == 401
    bad = client.get("/dashboard/feed?interval=0", headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "interval"


def test_feed_events_and_timelines(client: TestClient) -> None:
    ctx = client.app.state.ctx  # type: ignore[attr-defined]
    manager, view = ctx.manager, ctx.live_view
    now = time.perf_counter()
    for i in range(10):
        view.observe_finished(_finished(f"done{i}", now - 2, ttft=0.1 * (i + 1), total=1.0 + i))
    running = ReqState("live1", [5, 6, 7, 8])
    running.created = now - 0.6
    running.output_ids = [1, 2]
    manager.states["live1"] = running
    try:
        event = client.get("/dashboard/feed?once=1", headers=AUTH).json()
        assert event["running"] == 1 and event["kv_usage"] == 0.3 and event["decode_batch_size"] == 1
        assert event["ttft"]["p50"] == pytest.approx(0.55) and event["ttft"]["p99"] == pytest.approx(0.991)
        assert event["cache_hit_rate"] == pytest.approx(0.25) and event["host_kv_usage"] is None
        assert [r["rid"] for r in event["requests"]] == ["live1"] and event["requests"][0]["state"] == "decoding"
        assert event["recent"][0]["rid"] == "done9"
        # The stream: events until the server drains (which ends it).
        with client.stream("GET", "/dashboard/feed?interval=0.25", headers=AUTH) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            seen = []
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if len(seen) == 2:
                        manager.draining = True
        manager.draining = False
        assert len(seen) >= 2 and seen[-1]["prefill_tokens_per_s"] > 0 and seen[-1]["decode_tokens_per_s"] > 0
        live = client.get("/dashboard/requests/live1", headers=AUTH).json()
        assert live["state"] == "decoding"
        assert [e["stage"] for e in live["events"]] == ["arrived", "queued", "scheduled", "prefill_chunk"]
    finally:
        manager.states.pop("live1", None)
    done = client.get("/dashboard/requests/done3", headers=AUTH).json()
    assert [e["stage"] for e in done["events"]] == ["arrived", "queued", "scheduled", "prefill_chunk",
                                                    "first_token", "finished"]
    assert done["events"][-1]["t"] == pytest.approx(4.0) and done["finish_reason"] == "length"
    missing = client.get("/dashboard/requests/nope", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "rid"


def test_disable_dashboard(tokenizer: Any) -> None:
    with TestClient(_make_app(tokenizer, ScriptedManager, disable_dashboard=True), headers=AUTH) as c:
        assert c.get("/dashboard").status_code == 404 and c.get("/dashboard/feed").status_code == 404
        assert c.app.state.ctx.live_view is None  # type: ignore[attr-defined]


def test_percentile_and_window() -> None:
    assert percentile([], 0.5) is None and percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    view = LiveView(window_s=10)
    now = time.perf_counter()
    view.observe_finished(_finished("old", now - 100, ttft=5.0, total=6.0))
    view.observe_finished(_finished("new", now - 1, ttft=0.2, total=0.5))
    event = view.snapshot(INFO, [], {}, now=now)
    assert event["finished_in_window"] == 1 and event["ttft"]["p99"] == pytest.approx(0.2)
    assert event["itl"]["p50"] == pytest.approx(0.3 / 4)


def test_scheduler_states_and_stage_cap() -> None:
    def req(rid: str, retractions: int = 0, chunked: int = 0) -> Any:
        return SimpleNamespace(rid=rid, origin_input_ids=[1, 2], output_ids=[9], cached_tokens=1,
                               retractions=retractions, is_chunked=chunked, stages=[("queued", 0.0, 2)],
                               finished=lambda: False)

    g, q, r, p, d = req("g"), req("q"), req("r", retractions=1), req("p", chunked=1), req("d")
    sched = SimpleNamespace(reqs={x.rid: x for x in (g, q, r, p, d)}, grammar_queue=SimpleNamespace(waiting=[g]),
                            waiting_queue=[q, r], chunked_req=p, running_batch=SimpleNamespace(reqs=[d]))
    reply = live_requests(sched)
    assert {row["rid"]: row["state"] for row in reply["requests"]} == {
        "g": "grammar-compiling", "q": "queued", "r": "retracted", "p": "prefilling", "d": "decoding"}
    assert reply["decode_batch_size"] == 1
    for i in range(MAX_STAGES + 10):
        mark(d, "retracted", i)
    assert len(d.stages) == MAX_STAGES and d.stages[-1][2] == MAX_STAGES + 9


def test_otlp_endpoint_is_validated() -> None:
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint: invalid value 'localhost:4318'"):
        ServerArgs(otlp_traces_endpoint="localhost:4318").validate()
    ServerArgs(otlp_traces_endpoint="http://localhost:4318").validate()


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP traces receiver: keeps each decoded ExportTraceServiceRequest."""

    received: list[Any] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        body = self.rfile.read(int(self.headers["content-length"]))
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        type(self).received.append((self.path, message))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_spans_reach_an_otlp_collector() -> None:
    pytest.importorskip("opentelemetry.sdk")
    from engine.entrypoints.tracing import RequestTracer, phases

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tracer = RequestTracer(f"http://127.0.0.1:{server.server_port}", "tiny")
        state = _finished("trace-me", time.perf_counter() - 1.0, ttft=0.1, total=0.5)
        state.meta["stages"] = [("queued", state.created + 0.001, 4), ("scheduled", state.created + 0.002, 0),
                                ("prefill_chunk", state.created + 0.002, 2), ("prefill_chunk", state.created + 0.05, 2)]
        tracer.observe_finished(state)
        tracer.shutdown()
    finally:
        server.shutdown()
    assert _Collector.received and _Collector.received[0][0] == "/v1/traces"
    spans = [span for _, message in _Collector.received for rs in message.resource_spans
             for ss in rs.scope_spans for span in ss.spans]
    by_name = {span.name: span for span in spans}
    assert set(by_name) == {"engine.request", "queue", "prefill", "decode"}
    root = by_name["engine.request"]
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["engine.request_id"].string_value == "trace-me" and attrs["gen_ai.usage.output_tokens"].int_value == 5
    assert [e.name for e in root.events] == ["arrived", "queued", "scheduled", "prefill_chunk", "prefill_chunk",
                                             "first_token", "finished"]
    assert [e.name for e in by_name["prefill"].events] == ["prefill_chunk", "prefill_chunk"]
    for name in ("queue", "prefill", "decode"):
        assert by_name[name].parent_span_id == root.span_id and by_name[name].trace_id == root.trace_id
    assert (root.end_time_unix_nano - root.start_time_unix_nano) == pytest.approx(0.5e9, rel=1e-3)
    # A retraction splits the phases: queue, prefill, queue again, prefill, decode.
    stages = [("scheduled", 1.0, 0), ("retracted", 2.0, 0), ("scheduled", 3.0, 0)]
    assert [p[0] for p in phases(stages, 0.0, 4.0, 5.0)] == ["queue", "prefill", "queue", "prefill", "decode"]


def test_server_flag_wires_the_tracer(tokenizer: Any) -> None:
    """--otlp-traces-endpoint: the app's tokenizer manager hands finished requests to the tracer,
    and the server's shutdown exports what is queued."""
    pytest.importorskip("opentelemetry.sdk")
    _Collector.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        app = _make_app(tokenizer, ScriptedManager, otlp_traces_endpoint=f"http://127.0.0.1:{server.server_port}/v1/traces")
        with TestClient(app, headers=AUTH):
            state = _finished("wired", time.perf_counter() - 0.5, ttft=0.1, total=0.4)
            for callback in app.state.ctx.manager.on_finish:
                callback(state)
    finally:
        server.shutdown()
    spans = [span for _, message in _Collector.received for rs in message.resource_spans
             for ss in rs.scope_spans for span in ss.spans]
    roots = [s for s in spans if s.name == "engine.request"]
    assert len(roots) == 1 and {a.key: a.value.string_value for a in roots[0].attributes}["engine.request_id"] == "wired"
