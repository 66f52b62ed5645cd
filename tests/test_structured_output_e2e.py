"""Structured output end to end on the real default model (SmolLM2-135M-Instruct), CPU.

One ``engine serve`` for the module, spoken to with the official ``openai`` client: JSON
schemas with nested objects, arrays, enums and required fields yield output that parses and
validates (``jsonschema``), streaming and not; a regex constraint's output matches; SGLang's
native /generate takes json_schema, regex and ebnf; bad grammars are a 400 naming the field.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import Server, shared_default_server  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MAX_TOKENS = 96

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "artist", "teacher"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                    "required": ["city", "country"]},
        "skills": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "maxItems": 3,
                 "items": {"type": "object",
                           "properties": {"day": {"enum": ["mon", "tue", "wed"]},
                                          "temp": {"type": "integer", "minimum": -50, "maximum": 60}},
                           "required": ["day", "temp"]}},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "unit", "days", "sunny"],
}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """The session's shared server on the embedded default model."""
    return shared_default_server(request.config, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def _response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _content(stream: Any) -> tuple[str, list[str]]:
    text, finish = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                finish.append(c.finish_reason)
    return text, finish


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    """Two schemas with nested objects, arrays, enums and required fields; plain and streamed."""
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Describe a fictional person as JSON."}],
        temperature=0, max_tokens=MAX_TOKENS, response_format=_response_format(PERSON))
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Give a weather forecast for Paris as JSON."}],
        temperature=0.7, seed=5, max_tokens=MAX_TOKENS, response_format=_response_format(WEATHER), stream=True)
    text, finish = _content(stream)
    assert finish == ["stop"], (finish, text)
    jsonschema.validate(json.loads(text), WEATHER)


def test_json_object_and_completions_api(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Give me a JSON object with two fruits."}],
        temperature=0, max_tokens=MAX_TOKENS, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop", reply.choices[0]
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    # The same WEATHER schema again: compiled once, cached since.
    done = client.completions.create(
        model="default", prompt="<|im_start|>user\nWeather in Rome?<|im_end|>\n<|im_start|>assistant\n",
        temperature=0, max_tokens=MAX_TOKENS, stream=True, extra_body={"response_format": _response_format(WEATHER)})
    text = "".join(c.choices[0].text for c in done if c.choices)
    jsonschema.validate(json.loads(text), WEATHER)


def test_regex_output_matches(client: openai.OpenAI) -> None:
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "When did the Apollo 11 mission land?"}],
        temperature=0, max_tokens=32, extra_body={"regex": pattern})
    assert re.fullmatch(pattern, reply.choices[0].message.content), reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_grammar_that_cannot_finish_ends_with_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=6,
        extra_body={"regex": "[a-z]{200}"})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6


def test_native_generate_with_grammars(server: Server) -> None:
    prompt = "<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    cases = [({"json_schema": json.dumps(WEATHER)}, lambda t: jsonschema.validate(json.loads(t), WEATHER)),
             ({"regex": "(yes|no), [a-z ]{1,12}\\."}, lambda t: re.fullmatch("(yes|no), [a-z ]{1,12}\\.", t)),
             ({"ebnf": 'root ::= ("yes" | "no") "!"'}, lambda t: re.fullmatch("(yes|no)!", t))]
    for params, check in cases:
        r = httpx.post(server.url + "/generate", timeout=600, json={
            "text": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, **params}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert check(out["text"]) is not False, (params, out["text"])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"regex": "a(b"}, "regex"),
    ({"ebnf": "root ::= undefined"}, "ebnf"),
])
def test_bad_grammars_are_a_400(client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       extra_body=body)
    assert info.value.body["param"] == param, info.value.body
