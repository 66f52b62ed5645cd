"""Structured output and logit_bias through the HTTP APIs, in-process (scripted generation).

What reaches the engine (the SamplingParams a request becomes) and the 400s for bad grammars,
each naming the API's field; the constrained output itself is tested on the scheduler
(core/tests/managers/test_scheduler_grammar.py) and end to end (tests/test_structured_output_e2e.py).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

sys.path.insert(0, os.path.dirname(__file__))
import test_http_app  # noqa: E402
from test_http_app import AUTH  # noqa: E402

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer(llama_ckpt: str) -> Any:
    from engine.managers.tokenizer_utils import load_tokenizer

    return load_tokenizer(llama_ckpt)


class _Manager(test_http_app.ScriptedManager):
    on_route: list[Any] = []  # the server registers router observers on every manager


@pytest.fixture
def client(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setattr(test_http_app, "ScriptedManager", _Manager)
    with TestClient(test_http_app._app(tokenizer), headers=AUTH) as c:
        yield c


def _sent(client: TestClient) -> dict[str, Any]:
    """The sampling params of the last request the scripted manager received."""
    return client.app.state.ctx.manager.sent[-1].sampling_params  # type: ignore[attr-defined]


@pytest.mark.parametrize("response_format, want", [
    ({"type": "text"}, {}),
    ({"type": "json_object"}, {"json_schema": '{"type": "object"}'}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
     {"json_schema": json.dumps(SCHEMA)}),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, {"json_schema": '{"type": "object"}'}),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_response_format_becomes_a_grammar(client: TestClient, route: str, response_format: dict[str, Any],
                                           want: dict[str, Any]) -> None:
    body = dict(CHAT) if route.endswith("chat/completions") else {"prompt": "x", "max_tokens": 4}
    for stream in (False, True):
        r = client.post(route, json={**body, "response_format": response_format, "stream": stream})
        assert r.status_code == 200, r.text
        sent = _sent(client)
        assert {k: sent[k] for k in ("json_schema", "regex", "ebnf") if k in sent} == want


def test_openai_extensions_and_logit_bias_reach_the_engine(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "regex": "[a-z]+", "logit_bias": {"12": -100, "7": 5.5}})
    assert r.status_code == 200, r.text
    assert _sent(client)["regex"] == "[a-z]+" and _sent(client)["logit_bias"] == {12: -100, 7: 5.5}
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "ebnf": 'root ::= "a"'})
    assert r.status_code == 200 and _sent(client)["ebnf"] == 'root ::= "a"'


def test_native_generate_takes_grammars(client: TestClient) -> None:
    for params in ({"json_schema": json.dumps(SCHEMA)}, {"regex": "[0-9]+"}, {"ebnf": 'root ::= "yes" | "no"'},
                   {"logit_bias": {"5": 1.0}}):
        r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, **params}})
        assert r.status_code == 200, (params, r.text)


@pytest.mark.parametrize("route, body, param, needle", [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema", "nonsense"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": "not an object"}}}, "response_format.json_schema.schema", "expected a JSON Schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "required"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ("/v1/chat/completions", {**CHAT, "regex": "a(b"}, "regex", "parenthesis"),
    ("/v1/chat/completions", {**CHAT, "regex": "a", "response_format": {"type": "json_object"}}, "response_format",
     "combined"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, "logit_bias", "-100 to 100"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}},
     "response_format.json_schema.schema", "frobnicate"),
    ("/v1/completions", {"prompt": "x", "ebnf": "root ::= missing"}, "ebnf", "missing"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{not json"}}, "json_schema", "not valid JSON"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "(("}}, "regex", "invalid regex"),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= "}}, "ebnf", "invalid ebnf"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "ebnf", "at most one"),
])
def test_bad_grammars_are_a_400_naming_the_field(client: TestClient, route: str, body: dict[str, Any], param: str,
                                                 needle: str) -> None:
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].endswith(param) and needle in error["message"], error
    assert not client.app.state.ctx.manager.sent, "a bad grammar reached the engine"  # type: ignore[attr-defined]
