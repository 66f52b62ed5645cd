"""The HTTP app in-process, on a scripted tokenizer manager (no engine processes).

Checks response shapes against the ``openai`` package's own types, SSE framing,
the front door (API key, body limit), error bodies and request expansion.
Engine-backed behaviour is covered end to end in ``tests/test_server_e2e*.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from starlette.testclient import TestClient

from engine.config import ServerArgs
from engine.entrypoints.http_server import create_app
from engine.managers.io_struct import ControlReply, SchedulerReady
from engine.managers.tokenizer_manager import GenerateRequest, ReqState, TokenizerManager
from engine.managers.tokenizer_pool import TokenizerPool
from engine.router.router import Router

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB = 2048


class ScriptedManager(TokenizerManager):
    """Real validation (prepare), scripted generation: token k of a request is (last prompt id + k + 1)."""

    sends_on_submit = False  # no scheduler: requests go through ``generate``

    def __init__(self, args: Any, model_path: str, ipc: Any, ready: SchedulerReady, processes: list[Any],
                 tokenizer: Any) -> None:
        self.args, self.ready, self.tokenizer, self.processes = args, ready, tokenizer, processes
        self.context_len = ready.context_len
        self.states: dict[str, ReqState] = {}
        self.dead: str | None = None
        self.on_finish: list[Any] = []
        self.on_route: list[Any] = []
        self.router = Router(1)
        self.aborted: list[str] = []
        self.sent: list[GenerateRequest] = []
        self.draining = False
        self.abort_messages: dict[str, str] = {}
        self.token_delay = 0.0  # seconds per scripted token (tests that act mid-request raise it)
        self.groups: dict[str, set[str]] = {}
        self._group_of: dict[str, list[str]] = {}
        self.pool = TokenizerPool(tokenizer, 1, ready.context_len)

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def abort(self, rid: str, message: str = "aborted by request") -> list[str]:
        targets = self.abort_targets(rid)
        self.aborted.extend(targets)
        for target in targets:  # the scheduler ends it with SGLang's abort finish reason
            self.abort_messages[target] = message
        return targets

    async def control(self, kind: str, timeout: float = 10.0) -> ControlReply:
        return ControlReply(kind, 0, True, {"max_total_num_tokens": 100, "kv_free_tokens": 100,
                                            "kv_evictable_tokens": 0, "kv_used_tokens": 0, "kv_usage": 0.0,
                                            "num_running_reqs": len(self.states), "num_waiting_reqs": 0})

    async def generate(self, req: GenerateRequest, prepared: Any = None) -> AsyncIterator[dict[str, Any]]:
        ids, params = prepared or self.prepare(req)
        rid = req.rid or f"r{len(self.sent)}"
        self.sent.append(req)
        state = ReqState(rid, ids)
        self.states[rid] = state
        finished = False
        try:
            for k in range(params.max_new_tokens):
                await asyncio.sleep(self.token_delay)
                token = (ids[-1] + k + 1) % VOCAB
                state.output_ids.append(token)
                if req.return_logprob:
                    state.output_token_logprobs.append((-1.0 - k, token))
                    state.output_top_logprobs.append([(-0.5, token), (-2.0, (token + 1) % VOCAB)][: req.top_logprobs_num])
                done = k + 1 == params.max_new_tokens or rid in self.abort_messages
                if rid in self.abort_messages:
                    state.finished_reason = {"type": "abort", "message": self.abort_messages.pop(rid)}
                    finished = True
                elif done:
                    state.finished_reason = {"type": "length", "length": params.max_new_tokens}
                    finished = True
                state.text = self.tokenizer.decode(state.output_ids) if self.tokenizer else ""
                if req.stream or done:
                    out = self._output(state)
                    out["meta_info"]["cached_tokens"] = 2
                    yield out
                if finished:
                    break
        finally:
            self.states.pop(rid, None)
            self._leave_groups(rid)
            if not finished:
                self.aborted.append(rid)


@pytest.fixture(scope="module")
def tokenizer(llama_ckpt: str) -> Any:
    from engine.managers.tokenizer_utils import load_tokenizer

    return load_tokenizer(llama_ckpt)


def _app(tokenizer: Any, **kwargs: Any) -> Any:
    args = ServerArgs(model_path="/models/tiny", api_key=KEY)
    ready = SchedulerReady(max_total_num_tokens=100, max_running_requests=8, context_len=64, vocab_size=VOCAB,
                           device="cpu", attention_backend="torch_native", platform="cpu", dtype="float32",
                           eos_token_ids=[3], plugins=[{"name": "cpu", "status": "ok"}])
    runtime = SimpleNamespace(args=args, model_path="/models/tiny", ipc=None, ready=ready, processes=[])
    return create_app(runtime, tokenizer, manager_factory=ScriptedManager, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def client(tokenizer: Any) -> Iterator[TestClient]:
    with TestClient(_app(tokenizer), headers=AUTH) as c:
        yield c


def _events(body: str) -> list[Any]:
    lines = [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chat_completion_matches_openai_schema(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3, "n": 2, "seed": 5, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    body = ChatCompletion.model_validate(r.json())
    assert body.id.startswith("chatcmpl-") and body.object == "chat.completion" and body.model == "tiny"
    assert [c.index for c in body.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in body.choices)
    assert body.usage is not None and body.usage.completion_tokens == 6  # both choices
    assert body.usage.prompt_tokens == len(client.app.state.ctx.manager.sent[0].input_ids)  # counted once
    assert body.usage.prompt_tokens_details.cached_tokens == 2
    lp = body.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 3 and len(lp.content[0].top_logprobs) == 2
    seeds = [req.sampling_params["seed"] for req in client.app.state.ctx.manager.sent]
    assert seeds == [5, 6]


def test_chat_stream_chunks_and_usage(client: TestClient) -> None:
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
               "stream_options": {"include_usage": True}}
    r = client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    chunks = [ChatCompletionChunk.model_validate(e) for e in events]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.post("/v1/chat/completions", json={**payload, "stream": False, "stream_options": None})
    assert text == plain.json()["choices"][0]["message"]["content"]


def test_completions_batch_echo_and_legacy_logprobs(client: TestClient, tokenizer: Any) -> None:
    r = client.post("/v1/completions", json={"prompt": [[5, 6, 7], [9, 10]], "max_tokens": 2, "n": 2,
                                             "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    body = Completion.model_validate(r.json())
    assert body.id.startswith("cmpl-") and len(body.choices) == 4
    assert [c.index for c in body.choices] == [0, 1, 2, 3]
    assert body.usage is not None and body.usage.prompt_tokens == 5 and body.usage.completion_tokens == 8
    first = body.choices[0]
    echo = tokenizer.decode([5, 6, 7])
    assert first.text.startswith(echo)
    assert first.logprobs is not None and first.logprobs.tokens is not None
    assert len(first.logprobs.tokens) == 2 and len(first.logprobs.top_logprobs or []) == 2
    # Offsets point into the choice's text, after the echoed prompt.
    assert first.logprobs.text_offset == [len(echo), len(echo) + len(first.logprobs.tokens[0])]


def test_completion_stream_text_equals_plain(client: TestClient) -> None:
    payload = {"prompt": "Hello there", "max_tokens": 5, "echo": True}
    plain = client.post("/v1/completions", json=payload).json()["choices"][0]["text"]
    events = _events(client.post("/v1/completions", json={**payload, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events) == plain
    assert plain.startswith("Hello there")


def test_native_generate_single_batch_and_stream(client: TestClient) -> None:
    one = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2},
                                         "return_logprob": True, "return_text_in_logprobs": True})
    assert one.status_code == 200, one.text
    out = one.json()
    assert out["output_ids"] == [7, 8] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["output_token_logprobs"][0][:2] == [-1.0, 7]
    assert isinstance(out["meta_info"]["output_token_logprobs"][0][2], str)
    batch = client.post("/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1, "n": 2}})
    assert batch.status_code == 200 and len(batch.json()) == 4
    events = _events(client.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 3},
                                                    "stream": True}).text)
    assert [e["output_ids"] for e in events] == [[6], [6, 7], [6, 7, 8]]


@pytest.mark.parametrize("payload, status, param, needle", [
    ({"messages": []}, 400, "messages", "at least 1"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature", "less than or equal to 2"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ({"messages": [{"role": "user", "content": "x"}], "temprature": 1}, 400, "temprature", "did you mean temperature"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "wizard"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}, 400, "max_tokens", "too large"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400, "messages[0].content[0].type", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, 400, "stop", "invalid value 5"),
    ({"model": "tiny"}, 400, "messages", "required"),
])
def test_chat_bad_inputs(client: TestClient, payload: dict[str, Any], status: int, param: str, needle: str) -> None:
    r = client.post("/v1/chat/completions", json=payload)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_invalid_json_and_non_object(client: TestClient) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]


def test_unknown_route_and_method(client: TestClient) -> None:
    assert client.get("/v2/nothing").json()["error"]["type"] == "not_found_error"
    assert client.get("/v1/chat/completions").status_code == 405


def test_api_key_guards_everything_but_health(tokenizer: Any) -> None:
    with TestClient(_app(tokenizer)) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers=AUTH).status_code == 200


def test_body_limit(tokenizer: Any) -> None:
    with TestClient(_app(tokenizer, max_body_bytes=1000), headers=AUTH) as c:
        big = {"prompt": "x" * 2000}
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413 and "limit is 1000 bytes" in r.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
            yield b'{"prompt": "'
            yield b"x" * 2000
            yield b'"}'

        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413


def test_tokenize_detokenize_models_and_info(client: TestClient, tokenizer: Any) -> None:
    ids = client.post("/v1/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["tokens"] == tokenizer.encode("Hello world") and ids["count"] == len(ids["tokens"])
    text = client.post("/v1/detokenize", json={"tokens": ids["tokens"]}).json()["text"]
    assert text == "Hello world"
    bad = client.post("/v1/detokenize", json={"tokens": [99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    chat = client.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 64
    info = client.get("/get_server_info").json()
    assert info["api_key"] == "<redacted>" and info["kv_used_tokens"] == 0 and info["plugins"]
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "engine_num_running_reqs" in metrics.text


def test_abort_request_and_duplicate_rid(client: TestClient) -> None:
    unknown = client.post("/abort_request", json={"rid": "abc"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "rid", unknown.text
    assert "abc" in unknown.json()["error"]["message"]
    assert client.post("/abort_request", json={}).status_code == 400
    r = client.post("/generate", json={"text": ["a", "b"], "rid": ["same", "same"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


def _stream_in_thread(client: TestClient, path: str, body: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        result["response"] = client.post(path, json=body)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_abort_parent_rid_ends_every_choice_with_abort_reason(client: TestClient) -> None:
    manager = client.app.state.ctx.manager
    manager.token_delay = 0.05
    thread, result = _stream_in_thread(client, "/generate", {
        "text": "hi", "rid": "parent", "stream": True, "sampling_params": {"n": 2, "max_new_tokens": 50}})
    _wait_for(lambda: {"parent-0", "parent-1"} <= set(manager.states))
    r = client.post("/abort_request", json={"rid": "parent"})
    assert r.status_code == 200 and r.json()["aborted"] == ["parent-0", "parent-1"], r.text
    thread.join(30)
    events = _events(result["response"].text)
    finals = [e for e in events if "meta_info" in e and e["meta_info"]["finish_reason"]]
    assert sorted(e["index"] for e in finals) == [0, 1]
    assert all(e["meta_info"]["finish_reason"]["type"] == "abort" for e in finals), finals
    assert all(len(e["output_ids"]) < 50 for e in finals)
    assert events[-1]["error"]["code"] == "request_aborted"  # then [DONE] (checked by _events)
    assert not manager.groups  # the group id is released with its requests


def test_non_streamed_native_abort_is_a_400_that_carries_meta_info(client: TestClient) -> None:
    manager = client.app.state.ctx.manager
    manager.token_delay = 0.05
    thread, result = _stream_in_thread(client, "/generate", {
        "text": "hi", "rid": "plain", "sampling_params": {"max_new_tokens": 50}})
    _wait_for(lambda: "plain" in manager.states)
    assert client.post("/abort_request", json={"rid": "plain"}).json()["aborted"] == ["plain"]
    thread.join(30)
    r = result["response"]
    body = r.json()
    assert r.status_code == 400 and body["error"]["code"] == "request_aborted", r.text
    assert body["meta_info"]["finish_reason"]["type"] == "abort" and body["meta_info"]["id"] == "plain", body
    assert len(body["output_ids"]) < 50


def test_abort_one_choice_lets_the_others_finish(client: TestClient) -> None:
    manager = client.app.state.ctx.manager
    manager.token_delay = 0.02
    thread, result = _stream_in_thread(client, "/v1/completions", {
        "model": "tiny", "prompt": "hi", "rid": "cmp", "n": 2, "max_tokens": 40, "stream": True})
    _wait_for(lambda: {"cmp-0", "cmp-1"} <= set(manager.states))
    assert client.post("/abort_request", json={"rid": "cmp-1"}).json()["aborted"] == ["cmp-1"]
    thread.join(30)
    events = _events(result["response"].text)
    reasons = {c["index"]: c["finish_reason"] for e in events if "choices" in e for c in e["choices"]
               if c["finish_reason"]}
    assert reasons == {0: "length", 1: "abort"}, reasons
    assert events[-1]["error"]["code"] == "request_aborted"


def test_draining_refuses_new_requests_and_health(client: TestClient) -> None:
    manager = client.app.state.ctx.manager
    manager.arrivals.begin_drain()  # what drain() does first: requests arriving from now on are new
    manager.draining = True
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text


def test_over_long_text_is_refused_before_tokenizing(client: TestClient) -> None:
    pool = client.app.state.ctx.manager.pool
    assert pool.max_chars > 0
    huge = "x" * (pool.max_chars + 1)
    for path, body, param in [("/v1/completions", {"model": "tiny", "prompt": huge}, "prompt"),
                              ("/generate", {"text": huge}, "text"),
                              ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": huge}]},
                               "messages")]:
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and f"{pool.max_chars} characters" in error["message"], error


def test_openapi_schema_builds_without_warnings(client: TestClient) -> None:
    # A route serving two methods under one function gave both one operation id, and FastAPI
    # warned "Duplicate Operation ID" each time /openapi.json was built.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = client.get("/openapi.json").json()
    assert {"get", "post"} <= set(schema["paths"]["/flush_cache"])
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))


def test_server_info_has_sglang_layout(client: TestClient) -> None:
    for route in ("/get_server_info", "/server_info"):
        info = client.get(route).json()
        (state,) = info["internal_states"]  # one data-parallel rank
        assert state["max_total_num_tokens"] == info["max_total_num_tokens"] == 100
        assert state["memory_usage"]["token_capacity"] == 100 and state["last_gen_throughput"] == 0.0
        assert "avg_spec_accept_length" not in state
        assert info["max_req_input_len"] == 63 and info["version"]
    assert client.get("/model_info").json() == client.get("/get_model_info").json()


def test_model_info_has_the_chat_template_and_special_tokens(client: TestClient, tokenizer: Any) -> None:
    # What a client needs to render chat roles as /v1/chat/completions does (engine_lang does).
    info = client.get("/get_model_info").json()
    assert info["chat_template"] == (tokenizer.chat_template or None)
    assert info["special_tokens"] == {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    assert info["special_tokens"]  # the tiny tokenizer has at least an eos token


def test_a_request_received_before_the_drain_is_drained_and_a_later_one_refused(tokenizer: Any) -> None:
    """A request whose body is still arriving when the drain begins gets its full answer; one
    that arrives after the drain began gets a 503."""
    import httpx

    app = _app(tokenizer)
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3}).encode()

    async def scenario() -> tuple[httpx.Response, httpx.Response, int]:
        async with app.router.lifespan_context(app):
            manager = app.state.ctx.manager
            arrived = asyncio.Event()
            release = asyncio.Event()

            async def slow_body() -> AsyncIterator[bytes]:
                arrived.set()  # the request has arrived: its handler is reading the body
                await release.wait()
                yield body

            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as c:
                early = asyncio.ensure_future(c.post("/v1/completions", content=slow_body(),
                                                     headers={"content-type": "application/json"}))
                await arrived.wait()
                drain = asyncio.ensure_future(manager.drain(30))
                await asyncio.sleep(0.1)  # the drain has begun and waits for the early request
                late = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                release.set()
                return await early, late, await drain

    early, late, failed = asyncio.run(scenario())
    assert early.status_code == 200 and early.json()["choices"][0]["finish_reason"] == "length", early.text
    assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down", late.text
    assert failed == 0
