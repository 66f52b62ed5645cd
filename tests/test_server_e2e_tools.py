"""End to end on the real default model (SmolLM2-135M-Instruct): tool calling and reasoning
through the official ``openai`` client and langchain-openai.

One server, ``--tool-call-parser hermes --reasoning-parser deepseek-r1``. SmolLM2's chat template
ignores ``tools``, so the engine writes them into the system prompt; ``tool_choice: required``
and a named choice are constrained by a JSON schema, so even this small model answers with a
call whose arguments validate. The deepseek-r1 parser treats an output without ``</think>`` as
reasoning, which makes every plain answer of this model a ``reasoning_content`` test.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Literal

import jsonschema
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import MODEL_NAME, Server, launch, running  # noqa: E402

# Bounded schemas (enums, short strings, few items): a 135M model under a grammar may otherwise
# run on inside a free string until max_tokens.
CITIES = ["Paris", "Rome", "London", "Berlin"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": CITIES}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string", "enum": CITIES}, "destination": {"type": "string", "enum": CITIES},
        "passengers": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name"], "additionalProperties": False}}},
        "required": ["origin", "destination", "passengers"], "additionalProperties": False}}}
TOOLS = [WEATHER, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [[{"role": "user", "content": "What is the weather in Paris?"}],
           [{"role": "user", "content": "Book a flight from Paris to Rome for Ann."}]]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from engine.model_executor.checkpoint import resolve_checkpoint

    model_dir = resolve_checkpoint(None)  # the default model, converted once into $ENGINE_CACHE_DIR
    srv = launch(model_dir, str(tmp_path_factory.mktemp("tools-e2e")), "--tool-call-parser", "hermes",
                 "--reasoning-parser", "deepseek-r1", "--max-total-tokens", "8192", api_key=None)
    with running(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def _streamed_calls(chunks: list[Any]) -> tuple[list[dict[str, str]], str | None]:
    calls: list[dict[str, str]] = []
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function" and d.function.name
                calls.append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""})
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
    return calls, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice_yields_valid_calls(client: openai.OpenAI, stream: bool) -> None:
    for messages in PROMPTS[:1] if stream else PROMPTS:
        # One call each (parallel_tool_calls false: the schema asks for exactly one), to keep it short.
        kw: dict[str, Any] = dict(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS)
        if stream:
            calls, finish = _streamed_calls(list(client.chat.completions.create(**kw, stream=True)))
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in choice.message.tool_calls or []]
            finish = choice.finish_reason
            assert not choice.message.content
        assert finish == "tool_calls" and len(calls) == 1, (messages, calls, finish)
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_choice_yields_a_valid_call(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = dict(model=MODEL_NAME, messages=PROMPTS[1], tools=TOOLS, temperature=0,
                              tool_choice={"type": "function", "function": {"name": "book_flight"}},
                              max_tokens=MAX_TOKENS)
    if stream:
        calls, finish = _streamed_calls(list(client.chat.completions.create(**kw, stream=True)))
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
        finish = choice.finish_reason
    assert [c["name"] for c in calls] == ["book_flight"] and finish == "stop"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["book_flight"])


def test_a_conversation_with_earlier_calls_and_tool_results(client: openai.OpenAI) -> None:
    messages = [*PROMPTS[0],
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
                {"role": "user", "content": "And in Rome?"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=MAX_TOKENS)
    jsonschema.validate(json.loads(reply.choices[0].message.tool_calls[0].function.arguments), SCHEMAS["get_weather"])
    # The tools went into the prompt (SmolLM2's template ignores them): it is longer with them.
    plain = client.chat.completions.create(model=MODEL_NAME, messages=PROMPTS[0], max_tokens=1)
    with_tools = client.chat.completions.create(model=MODEL_NAME, messages=PROMPTS[0], tools=TOOLS, max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def test_reasoning_content_whole_and_streamed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
                              temperature=0, max_tokens=32)
    message = client.chat.completions.create(**kw).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert "Paris" in reasoning and not message.content  # no </think>: all reasoning under deepseek-r1
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    assert streamed == reasoning and not "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_input_is_a_400_naming_the_field(server: Server, body: dict[str, Any], param: str) -> None:
    r = server.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": PROMPTS[0], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- langchain-openai ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(server: Server) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL_NAME, base_url=server.url + "/v1", api_key="none", temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0, timeout=600)


def _weather_tool() -> Any:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Rome", "London"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather in a city."""
        return f"18 {unit} in {city}"

    return get_weather


@pytest.mark.parametrize("tool_choice", ["get_weather", "any"])
def test_langchain_bind_tools(chat_model: Any, tool_choice: str) -> None:
    bound = chat_model.bind_tools([_weather_tool()], tool_choice=tool_choice)
    reply = bound.invoke("What is the weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather", reply
    assert set(reply.tool_calls[0]["args"]) == {"city", "unit"} and all(isinstance(v, str) for v in reply.tool_calls[0]["args"].values())


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_with_structured_output(chat_model: Any, method: str) -> None:
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and its country."""

        name: str = Field(description="the city", max_length=16)
        country: str = Field(description="its country", max_length=16)

    question = "Name a large city in Italy. Answer in JSON with the keys name and country."
    if method == "json_mode":  # no schema reaches the server: the answer is some JSON object
        result = chat_model.with_structured_output(City.model_json_schema(), method=method).invoke(question)
        assert isinstance(result, dict), result
        return
    result = chat_model.with_structured_output(City, method=method).invoke(question)
    assert isinstance(result, City) and result.name and result.country, result
