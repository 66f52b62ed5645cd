"""End to end: malformed requests get the right status and a message naming the field,
and the server keeps serving good requests afterwards."""

from __future__ import annotations

import os
import sys
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import API_KEY, MODEL_NAME, Server, shared_server  # noqa: E402

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Server:
    return shared_server(request.config, tmp_path_factory, llama_ckpt_dir)


def _chat(**changes: Any) -> dict[str, Any]:
    body = {**GOOD_CHAT, **changes}
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()

# (name, path, json body or raw bytes, expected status, expected param, text the message must contain)
CASES: list[tuple[str, str, Any, int, str | None, str]] = [
    ("max_tokens wrong type", CHAT, _chat(max_tokens="ten"), 400, "max_tokens", "integer"),
    ("temperature wrong type", CHAT, _chat(temperature="hot"), 400, "temperature", "number"),
    ("messages not a list", CHAT, _chat(messages="hello"), 400, "messages", "array"),
    ("content wrong type", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", "string"),
    ("missing messages", CHAT, _chat(messages=_DROP), 400, "messages", "required"),
    ("missing role", CHAT, _chat(messages=[{"content": "x"}]), 400, "messages[0].role", "required"),
    ("empty messages", CHAT, _chat(messages=[]), 400, "messages", "at least 1"),
    ("negative max_tokens", CHAT, _chat(max_tokens=-1), 400, "max_tokens", "greater than or equal to 0"),
    ("huge max_tokens", CHAT, _chat(max_tokens=10**9), 400, "max_tokens", "too large"),
    ("temperature too high", CHAT, _chat(temperature=2.5), 400, "temperature", "less than or equal to 2"),
    ("negative temperature", CHAT, _chat(temperature=-0.1), 400, "temperature", "greater than or equal to 0"),
    ("top_p zero", CHAT, _chat(top_p=0), 400, "top_p", "greater than 0"),
    ("n zero", CHAT, _chat(n=0), 400, "n", "greater than or equal to 1"),
    ("typo field", CHAT, _chat(temprature=0.5), 400, "temprature", "did you mean temperature"),
    ("top_logprobs without logprobs", CHAT, _chat(top_logprobs=2), 400, "top_logprobs", "logprobs"),
    ("tool without a function", CHAT, _chat(tools=[{"type": "function"}]), 400, "tools[0].function", "required"),
    ("tool without a name", CHAT, _chat(tools=[{"type": "function", "function": {}}]), 400, "tools[0].function.name", "required"),
    ("bad top_k", CHAT, _chat(top_k=0), 400, "top_k", "-1 (all) or an integer >= 1"),
    ("unknown model", CHAT, _chat(model="gpt-4o"), 404, "model", "does not exist"),
    ("prompt too long", COMPLETIONS, {"prompt": [5] * 5000, "max_tokens": 1}, 400, "prompt", "context length"),
    ("token id outside vocab", COMPLETIONS, {"prompt": [1, 999999], "max_tokens": 1}, 400, "prompt", "outside the vocabulary"),
    ("suffix rejected", COMPLETIONS, {"prompt": "a", "suffix": "b"}, 400, "suffix", "not supported"),
    ("empty stop string", COMPLETIONS, {"prompt": "a", "stop": [""]}, 400, "stop", "stop"),
    ("missing prompt", COMPLETIONS, {"max_tokens": 1}, 400, "prompt", "required"),
    ("invalid json", COMPLETIONS, b'{"prompt": "a",', 400, None, "not valid JSON"),
    ("body not an object", COMPLETIONS, b'"just a string"', 400, None, "JSON object"),
    ("native unknown sampling param", "/generate", {"text": "a", "sampling_params": {"max_tokenz": 1}}, 400,
     "max_tokenz", "did you mean max_new_tokens"),
    ("native both prompts", "/generate", {"text": "a", "input_ids": [1]}, 400, "text", "exactly one"),
    ("unknown route", "/v1/moderations", {"input": "a"}, 404, None, "no route"),
]


@pytest.mark.parametrize("name, path, body, status, param, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server: Server, name: str, path: str, body: Any, status: int, param: str | None, needle: str) -> None:
    if isinstance(body, bytes):
        r = server.post(path, content=body, headers={**server.headers, "content-type": "application/json"})
    else:
        r = server.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert needle in error["message"], error


def test_wrong_or_missing_api_key(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}):
        r = httpx.post(server.url + CHAT, json=GOOD_CHAT, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # /health needs no key
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_oversized_body_is_413(server: Server) -> None:
    body = b'{"prompt": "' + b"x" * (33 * 1024 * 1024) + b'"}'
    r = server.post(COMPLETIONS, content=body, headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_openai_client_sees_errors(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="x", temperature=9)


def test_abort_request_by_rid(server: Server) -> None:
    import threading

    result: dict[str, Any] = {}

    def run() -> None:
        result["r"] = server.post("/generate", json={
            "text": "abort me", "rid": "to-abort",
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0}})

    thread = threading.Thread(target=run)
    thread.start()
    for _ in range(100):  # until the scheduler has it (bounded)
        if server.get("/get_server_info").json()["num_running_reqs"]:
            break
    assert server.post("/abort_request", json={"rid": "to-abort"}).json() == {"success": True, "aborted": ["to-abort"]}
    thread.join(60)
    r = result["r"]
    assert r.status_code == 400 and "aborted" in r.json()["error"]["message"], r.text


def test_still_serves_after_bad_requests(server: Server) -> None:
    r = server.post(CHAT, json=GOOD_CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None
    assert server.get("/health").status_code == 200
