"""The chat route with tools and reasoning, in-process on a manager that "generates" scripted
text (no engine processes): auto tool calls read by the hermes parser after qwen3 reasoning,
whole and streamed, checked against the ``openai`` package's types."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from starlette.testclient import TestClient

from engine.config import ServerArgs
from engine.entrypoints.http_server import create_app
from engine.managers.io_struct import SchedulerReady
from engine.managers.tokenizer_manager import GenerateRequest, ReqState

OUTPUT = ('<think>\nThe user wants the weather; call get_weather twice.\n</think>\n\nChecking both.\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome, \\"IT\\""}}\n</tool_call>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
        "tools": [WEATHER], "max_tokens": 50}


def _scripted_manager() -> type:
    """test_http_app's ScriptedManager (kept in step with the tokenizer manager by its owners)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).with_name("test_http_app.py")
    spec = importlib.util.spec_from_file_location("_http_app_for_tools", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.ScriptedManager


class TextManager(_scripted_manager()):  # type: ignore[misc]
    """Real validation (prepare); the output is ``OUTPUT``, three characters per step."""

    async def generate(self, req: GenerateRequest, prepared: Any = None) -> AsyncIterator[dict[str, Any]]:
        ids, _ = prepared or self.prepare(req)
        self.sent.append(req)
        state = ReqState(req.rid or "r", ids)
        for end in range(3, len(OUTPUT) + 3, 3):
            await asyncio.sleep(0)
            state.text = OUTPUT[:end]
            state.output_ids.append(5)
            done = end >= len(OUTPUT)
            if done:
                state.finished_reason = {"type": "stop", "matched": 2}
            if req.stream or done:
                yield self._output(state)


@pytest.fixture(scope="module")
def client(llama_ckpt: str) -> Iterator[TestClient]:
    from engine.managers.tokenizer_utils import load_tokenizer

    tokenizer = load_tokenizer(llama_ckpt)
    args = ServerArgs(model_path="/models/tiny", tool_call_parser="hermes", reasoning_parser="qwen3")
    ready = SchedulerReady(max_total_num_tokens=4096, max_running_requests=8, context_len=2048, vocab_size=2048,
                           device="cpu", attention_backend="torch_native", platform="cpu", dtype="float32",
                           eos_token_ids=[2], plugins=[])
    runtime = SimpleNamespace(args=args, model_path="/models/tiny", ipc=None, ready=ready, processes=[])
    with TestClient(create_app(runtime, tokenizer, manager_factory=TextManager)) as c:  # type: ignore[arg-type]
        yield c


def test_auto_calls_after_reasoning(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 2})
    assert r.status_code == 200, r.text
    body = ChatCompletion.model_validate(r.json())
    for choice in body.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking both."
        assert r.json()["choices"][choice.index]["message"]["reasoning_content"] == \
            "The user wants the weather; call get_weather twice."
        calls = choice.message.tool_calls or []
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": 'Rome, "IT"'}]
        assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    one = client.post("/v1/chat/completions", json={**CHAT, "parallel_tool_calls": False}).json()
    assert [c["function"]["arguments"] for c in one["choices"][0]["message"]["tool_calls"]] == ['{"city": "Paris"}']


def test_streamed_deltas_add_up_to_the_whole_response(client: TestClient) -> None:
    whole = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    lines = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(line)) for line in lines[:-1]]
    reasoning = "".join(json.loads(line)["choices"][0]["delta"].get("reasoning_content", "") for line in lines[:-1])
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls: list[dict[str, str]] = []
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            if d.id is not None:
                calls.append({"name": d.function.name, "arguments": d.function.arguments or ""})
            else:
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert reasoning == whole["reasoning_content"] and content == whole["content"]
    assert calls == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in whole["tool_calls"]]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all("<" not in (c.choices[0].delta.content or "") for c in chunks)  # no markup leaks


def test_tool_choice_none_and_no_tools_leave_the_text(client: TestClient) -> None:
    none = client.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"}).json()["choices"][0]
    assert none["finish_reason"] == "stop" and "tool_calls" not in none["message"]
    assert none["message"]["content"].startswith("Checking both.\n<tool_call>")  # reasoning still split off
    plain = client.post("/v1/chat/completions", json={k: v for k, v in CHAT.items() if k != "tools"}).json()
    assert "<tool_call>" in plain["choices"][0]["message"]["content"]
