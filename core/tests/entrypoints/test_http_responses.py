"""``/v1/responses`` in-process, on a manager that "generates" a scripted text (no engine
processes): response and event shapes against the ``openai`` package's types, the event order,
tools and reasoning items, ``previous_response_id``, the store's eviction, background
responses and cancel, and the 400/404s naming the field."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from starlette.testclient import TestClient

from engine.config import ServerArgs
from engine.entrypoints.http_server import create_app
from engine.managers.io_struct import SchedulerReady
from engine.managers.tokenizer_manager import GenerateRequest, ReqState

sys.path.insert(0, os.path.dirname(__file__))
import test_http_app  # noqa: E402

CALLS = ('<think>\nWeather needs a tool.\n</think>\n\nChecking.\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
EVENTS = TypeAdapter(ResponseStreamEvent)


class TextManager(test_http_app.ScriptedManager):
    """Real validation (prepare); the output is ``script``, three characters per step, cut at
    max_new_tokens steps (finish reason length)."""

    script = "Hello there, friend."

    async def generate(self, req: GenerateRequest, prepared: Any = None) -> AsyncIterator[dict[str, Any]]:
        ids, params = prepared or self.prepare(req)
        self.sent.append(req)
        rid = req.rid or "r"
        state = ReqState(rid, ids)
        self.states[rid] = state
        finished = False
        try:
            for step, end in enumerate(range(3, len(self.script) + 3, 3)):
                await asyncio.sleep(self.token_delay)
                state.text = self.script[:end]
                state.output_ids.append(5)
                if rid in self.abort_messages:
                    state.finished_reason = {"type": "abort", "message": self.abort_messages.pop(rid)}
                elif step + 1 == params.max_new_tokens:
                    state.finished_reason = {"type": "length", "length": step + 1}
                elif end >= len(self.script):
                    state.finished_reason = {"type": "stop", "matched": 2}
                finished = state.finished_reason is not None
                if req.stream or finished:
                    yield self._output(state)
                if finished:
                    break
        finally:
            self.states.pop(rid, None)
            if not finished:
                self.aborted.append(rid)


def make_client(tokenizer: Any, **args: Any) -> TestClient:
    args = ServerArgs(model_path="/models/tiny", tool_call_parser="hermes", reasoning_parser="qwen3", **args)
    ready = SchedulerReady(max_total_num_tokens=4096, max_running_requests=8, context_len=2048, vocab_size=2048,
                           device="cpu", attention_backend="torch_native", platform="cpu", dtype="float32",
                           eos_token_ids=[2], plugins=[])
    runtime = SimpleNamespace(args=args, model_path="/models/tiny", ipc=None, ready=ready, processes=[])
    return TestClient(create_app(runtime, tokenizer, manager_factory=TextManager))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tokenizer(llama_ckpt: str) -> Any:
    from engine.managers.tokenizer_utils import load_tokenizer

    return load_tokenizer(llama_ckpt)


@pytest.fixture
def client(tokenizer: Any) -> Iterator[TestClient]:
    TextManager.script = "Hello there, friend."
    with make_client(tokenizer) as c:
        yield c


def _manager(client: TestClient) -> TextManager:
    return client.app.state.ctx.manager  # type: ignore[attr-defined,no-any-return]


def _events(r: Any) -> list[Any]:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        event = json.loads(data[len("data: "):])
        assert name == f"event: {event['type']}"
        events.append(EVENTS.validate_python(event))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_text_response_and_its_stream(client: TestClient) -> None:
    body = {"model": "tiny", "input": "Say hello", "instructions": "Be brief.", "metadata": {"k": "v"}}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    resp = Response.model_validate(r.json())
    assert resp.status == "completed" and resp.output_text == "Hello there, friend." and resp.metadata == {"k": "v"}
    assert [o.type for o in resp.output] == ["message"] and resp.usage and resp.usage.output_tokens == 7
    assert client.get(f"/v1/responses/{resp.id}").json() == r.json()
    prompt = client.app.state.ctx.tokenizer.decode(_manager(client).sent[-1].input_ids)  # type: ignore[attr-defined]
    assert "Be brief." in prompt and "Say hello" in prompt
    events = _events(client.post("/v1/responses", json={**body, "stream": True}))
    assert [e.type for e in events[:5]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added", "response.output_text.delta"]
    assert [e.type for e in events[-5:]] == ["response.output_text.delta", "response.output_text.done",
                                             "response.content_part.done", "response.output_item.done",
                                             "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there, friend."
    assert events[-1].response.output_text == resp.output_text and events[0].response.status == "in_progress"


def test_reasoning_and_function_calls(client: TestClient) -> None:
    TextManager.script = CALLS
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Paris and Rome?"}]}],
            "tools": [TOOL]}
    resp = Response.model_validate(client.post("/v1/responses", json=body).json())
    assert [o.type for o in resp.output] == ["reasoning", "message", "function_call", "function_call"]
    assert resp.output[0].content[0].text == "Weather needs a tool."  # type: ignore[union-attr,index]
    assert resp.output_text == "Checking."
    calls = [o for o in resp.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                 ("get_weather", {"city": "Rome"})]
    assert all(c.call_id.startswith("call_") for c in calls) and len({c.call_id for c in calls}) == 2
    events = _events(client.post("/v1/responses", json={**body, "stream": True}))
    args: dict[int, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    done = {e.output_index: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
    assert args == done and [json.loads(a) for a in done.values()] == [{"city": "Paris"}, {"city": "Rome"}]
    assert "response.reasoning_text.delta" in {e.type for e in events}
    final = events[-1].response
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == [(o.type, getattr(o, "name", None))
                                                                         for o in resp.output]


def test_previous_response_id_continues_the_conversation(client: TestClient) -> None:
    TextManager.script = CALLS
    first = client.post("/v1/responses", json={"input": "Weather in Paris?", "tools": [TOOL],
                                               "instructions": "FIRST-INSTRUCTIONS"}).json()
    call = next(o for o in first["output"] if o["type"] == "function_call")
    TextManager.script = "It is sunny."
    second = client.post("/v1/responses", json={
        "previous_response_id": first["id"], "tools": [TOOL],
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "SUNNY-22C"}]}).json()
    assert second["previous_response_id"] == first["id"] and second["output"][0]["content"][0]["text"] == "It is sunny."
    prompt = client.app.state.ctx.tokenizer.decode(_manager(client).sent[-1].input_ids)  # type: ignore[attr-defined]
    assert "Weather in Paris?" in prompt and "SUNNY-22C" in prompt and '"Paris"' in prompt
    assert "FIRST-INSTRUCTIONS" not in prompt  # instructions do not carry over
    unstored = client.post("/v1/responses", json={"input": "x", "store": False}).json()
    assert client.get(f"/v1/responses/{unstored['id']}").status_code == 404


def test_store_evicts_the_least_recently_used(tokenizer: Any) -> None:
    with make_client(tokenizer, responses_store_size=2) as c:
        ids = [c.post("/v1/responses", json={"input": "x"}).json()["id"] for _ in range(2)]
        assert c.get(f"/v1/responses/{ids[0]}").status_code == 200  # now the most recently used
        ids.append(c.post("/v1/responses", json={"input": "x"}).json()["id"])
        assert [c.get(f"/v1/responses/{i}").status_code for i in ids] == [200, 404, 200]
        gone = c.post("/v1/responses", json={"input": "x", "previous_response_id": ids[1]})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "previous_response_not_found"
        assert gone.json()["error"]["param"] == "previous_response_id"
        deleted = c.delete(f"/v1/responses/{ids[0]}").json()
        assert deleted == {"id": ids[0], "object": "response.deleted", "deleted": True}
        assert c.get(f"/v1/responses/{ids[0]}").status_code == 404


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temprature": 1}, "temprature"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"instructions": "x"}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "system", "content": "only reasoning follows"}, {"type": "reasoning", "summary": []}],
      "max_output_tokens": 99999}, "max_output_tokens"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input[0].arguments"),
])
def test_bad_requests_name_the_field(client: TestClient, body: dict[str, Any], param: str) -> None:
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_structured_output_and_sampling_reach_the_engine(client: TestClient) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    TextManager.script = '{"a": 1}'
    r = client.post("/v1/responses", json={"input": "x", "temperature": 0.5, "top_p": 0.9, "max_output_tokens": 9,
                                           "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}})
    assert r.status_code == 200, r.text
    params = _manager(client).sent[-1].sampling_params
    assert json.loads(params["json_schema"]) == schema
    assert (params["temperature"], params["top_p"], params["max_new_tokens"]) == (0.5, 0.9, 9)
    TextManager.script = "a long answer cut short"
    cut = Response.model_validate(client.post("/v1/responses", json={"input": "x", "max_output_tokens": 2}).json())
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert cut.output_text == "a long"


def test_background_response_and_cancel(client: TestClient) -> None:
    manager = _manager(client)
    manager.token_delay = 0.05
    try:
        r = client.post("/v1/responses", json={"input": "x", "background": True})
        assert r.status_code == 200 and r.json()["status"] == "queued" and r.json()["background"] is True
        rid = r.json()["id"]
        deadline = time.monotonic() + 10
        while rid not in manager.states and time.monotonic() < deadline:
            time.sleep(0.01)
        cancelled = client.post(f"/v1/responses/{rid}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        assert rid in manager.aborted and rid not in manager.states
        assert client.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
        manager.token_delay = 0.0
        done = client.post("/v1/responses", json={"input": "x", "background": True}).json()["id"]
        while client.get(f"/v1/responses/{done}").json()["status"] != "completed" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Response.model_validate(client.get(f"/v1/responses/{done}").json()).output_text == "Hello there, friend."
        again = client.post(f"/v1/responses/{done}/cancel")
        assert again.status_code == 400 and "completed" in again.json()["error"]["message"]
        plain = client.post("/v1/responses", json={"input": "x"}).json()["id"]
        assert client.post(f"/v1/responses/{plain}/cancel").status_code == 400
    finally:
        manager.token_delay = 0.0


def test_input_items_are_listed(client: TestClient) -> None:
    items = [{"role": "user", "content": "first"}, {"type": "message", "role": "user", "id": "msg_given",
                                                    "content": [{"type": "input_text", "text": "second"}]}]
    rid = client.post("/v1/responses", json={"input": items}).json()["id"]
    listed = client.get(f"/v1/responses/{rid}/input_items").json()
    assert listed["object"] == "list" and listed["has_more"] is False
    assert [i["content"][0]["text"] for i in listed["data"]] == ["second", "first"]  # newest first, as OpenAI
    assert listed["first_id"] == "msg_given" and listed["data"][1]["id"].startswith("msg_")
    page = client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 1}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["first"] and page["has_more"] is True
    rest = client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "after": page["last_id"]}).json()
    assert [i["id"] for i in rest["data"]] == ["msg_given"]
    assert client.get(f"/v1/responses/{rid}/input_items", params={"order": "up"}).json()["error"]["param"] == "order"


def test_an_aborted_generation_fails_the_response(client: TestClient) -> None:
    import threading

    manager = _manager(client)
    manager.token_delay = 0.05

    def abort_when_running() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            running = [rid for rid in list(manager.states) if rid.startswith("resp_")]
            if running:
                manager.abort(running[0], "aborted by an operator")
                return
            time.sleep(0.01)

    try:
        for stream in (True, False):
            aborter = threading.Thread(target=abort_when_running)
            aborter.start()
            r = client.post("/v1/responses", json={"input": "x", "stream": stream})
            aborter.join()
            if stream:
                last = _events(r)[-1]
                assert last.type == "response.failed" and last.response.status == "failed"
                assert last.response.error and "aborted by an operator" in last.response.error.message
            else:
                assert r.status_code == 400 and r.json()["error"]["code"] == "request_aborted", r.text
    finally:
        manager.token_delay = 0.0


def test_truncation_auto_drops_the_oldest_items(client: TestClient) -> None:
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"M{i}: " + "lorem ipsum " * 120}
             for i in range(9)]
    body = {"input": items, "instructions": "KEEP-ME", "max_output_tokens": 100}
    too_long = client.post("/v1/responses", json=body)
    assert too_long.status_code == 400, too_long.text
    r = client.post("/v1/responses", json={**body, "truncation": "auto"})
    assert r.status_code == 200, r.text
    sent = _manager(client).sent[-1].input_ids
    prompt = client.app.state.ctx.tokenizer.decode(sent)  # type: ignore[attr-defined]
    assert "KEEP-ME" in prompt and "M8:" in prompt and "M0:" not in prompt
    assert 2048 - len(sent) >= 100
