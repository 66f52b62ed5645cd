"""What current OpenAI-compatible clients send, in-process (scripted generation): every field of
OpenAI's chat and completions request schemas is accepted (acting where it applies), vLLM's
``guided_*`` fields become grammars, a streamed named tool call reassembles with OpenAI's
documented loop, ``ENGINE_API_KEY`` and CORS (``--allowed-origins``)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.chat import ChatCompletionChunk
from starlette.testclient import TestClient

sys.path.insert(0, os.path.dirname(__file__))
from test_http_responses import TextManager, make_client  # noqa: E402

pytest.importorskip("xgrammar")

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# A value for every field of the openai package's chat completion_create_params that the
# basic chat tests do not send.
CLIENT_FIELDS: dict[str, Any] = {
    "reasoning_effort": "low", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit"}, "safety_identifier": "u1", "verbosity": "low",
    "modalities": ["text"], "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
    "moderation": None, "store": True, "metadata": {"a": "b"}, "service_tier": "auto", "user": "me",
    "n": None, "logprobs": None, "top_logprobs": None, "stream_options": None, "parallel_tool_calls": True,
    "audio": None, "max_completion_tokens": 4, "seed": 1, "logit_bias": {"5": 1},
}


@pytest.fixture(scope="module")
def tokenizer(llama_ckpt: str) -> Any:
    from engine.managers.tokenizer_utils import load_tokenizer

    return load_tokenizer(llama_ckpt)


@pytest.fixture(scope="module")
def client(tokenizer: Any) -> Iterator[TestClient]:
    with make_client(tokenizer) as c:
        yield c


def _sent(client: TestClient) -> dict[str, Any]:
    return client.app.state.ctx.manager.sent[-1].sampling_params  # type: ignore[attr-defined,no-any-return]


def test_openai_client_fields_are_accepted(client: TestClient) -> None:
    TextManager.script = "Sunny."
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, **CLIENT_FIELDS})
    assert r.status_code == 200, r.text
    assert _sent(client)["max_new_tokens"] == 4
    streamed = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert streamed.status_code == 200 and '"usage":{"prompt_tokens"' in streamed.text
    r = client.post("/v1/completions", json={"prompt": "x", "n": None, "echo": None, "stream": None,
                                             "suffix": None, "best_of": None, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra, param", [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"verbosity": 3}, "verbosity"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
    ({"function_call": "maybe", "functions": [WEATHER["function"]]}, "function_call"),
])
def test_values_that_cannot_be_honoured_are_400s(client: TestClient, extra: dict[str, Any], param: str) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_guided_fields_become_grammars(client: TestClient) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    TextManager.script = "yes"
    for extra, key, value in [
        ({"guided_json": schema}, "json_schema", schema),
        ({"guided_json": json.dumps(schema)}, "json_schema", schema),
        ({"guided_regex": "(yes|no)"}, "regex", "(yes|no)"),
        ({"guided_choice": ["yes", 'no "way"']}, "ebnf", 'root ::= "yes" | "no \\"way\\""'),
        ({"guided_grammar": 'root ::= "yes"'}, "ebnf", 'root ::= "yes"'),
    ]:
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        sent = _sent(client)[key]
        assert (json.loads(sent) if key == "json_schema" else sent) == value
    r = client.post("/v1/completions", json={"prompt": "x", "guided_regex": "(yes|no)", "max_tokens": 2})
    assert r.status_code == 200 and _sent(client)["regex"] == "(yes|no)"


def test_functions_are_served_as_tools(client: TestClient) -> None:
    TextManager.script = '{"city": "Paris"}'
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "functions": [WEATHER["function"]],
                                                  "function_call": {"name": "get_weather"}})
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_streamed_named_tool_call_reassembles_with_openais_loop(client: TestClient) -> None:
    TextManager.script = '{"city": "Paris"}'
    r = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "tools": [WEATHER], "stream": True,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    lines = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    chunks = [ChatCompletionChunk.model_validate(json.loads(line)) for line in lines[:-1]]
    first = next(c for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert first.choices[0].delta.tool_calls[0].function.arguments == ""  # type: ignore[index,union-attr]
    # The loop of OpenAI's function-calling guide.
    final_tool_calls: dict[int, Any] = {}
    for chunk in chunks:
        for tool_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            index = tool_call.index
            if index not in final_tool_calls:
                final_tool_calls[index] = tool_call
            final_tool_calls[index].function.arguments += tool_call.function.arguments
    assert list(final_tool_calls) == [0] and final_tool_calls[0].function.name == "get_weather"
    assert json.loads(final_tool_calls[0].function.arguments) == {"city": "Paris"}


def test_engine_api_key_from_the_environment(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_API_KEY", "from-env")
    with make_client(tokenizer) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200
    with make_client(tokenizer, api_key="from-flag") as c:  # the flag (or YAML) wins
        assert c.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer from-flag"}).status_code == 200


def test_cors_preflight_needs_no_key(tokenizer: Any) -> None:
    origin = {"Origin": "http://localhost:3000"}
    preflight = {**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with make_client(tokenizer, api_key="k", allowed_origins=["http://localhost:3000"]) as c:
        r = c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        denied = c.get("/v1/models", headers=origin)
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://localhost:3000"
        ok = c.get("/v1/models", headers={**origin, "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = c.options("/v1/models", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    with make_client(tokenizer, api_key="k") as c:  # no --allowed-origins: no CORS headers
        r = c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 401 and "access-control-allow-origin" not in r.headers


def test_reasoning_effort_none_turns_thinking_off() -> None:
    from types import SimpleNamespace

    from engine.entrypoints.http.protocol import ChatCompletionRequest
    from engine.entrypoints.http.serving_chat import template_kwargs

    def kwargs(parser: Any, **fields: Any) -> Any:
        req = ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})
        return template_kwargs(SimpleNamespace(reasoning_parser=parser), req)  # type: ignore[arg-type]

    assert kwargs(object(), reasoning_effort="none") == {"enable_thinking": False}
    assert kwargs(object(), reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == \
        {"enable_thinking": True}  # the explicit template switch wins
    assert kwargs(object(), reasoning_effort="high") is None
    assert kwargs(None, reasoning_effort="none") is None  # no reasoning parser: not a reasoning model


def test_every_field_of_openais_request_schemas_is_declared() -> None:
    """The installed ``openai`` package's request TypedDicts: a field a newer client sends shows up here."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from openai.types.responses import response_create_params

    from engine.entrypoints.http.protocol import ChatCompletionRequest, CompletionRequest
    from engine.entrypoints.http.responses_items import ResponsesRequest

    for params, model in ((chat_create_params.CompletionCreateParamsStreaming, ChatCompletionRequest),
                          (completion_create_params.CompletionCreateParamsStreaming, CompletionRequest),
                          (response_create_params.ResponseCreateParamsStreaming, ResponsesRequest)):
        keys = params.__required_keys__ | params.__optional_keys__
        assert not keys - set(model.model_fields), (model.__name__, sorted(keys - set(model.model_fields)))
