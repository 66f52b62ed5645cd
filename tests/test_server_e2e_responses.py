"""End to end on the real default model (SmolLM2-135M-Instruct): the Responses API through the
OpenAI Agents SDK and the ``openai`` client, and what current clients send to chat completions.

One server, ``--tool-call-parser hermes``, its API key from ``ENGINE_API_KEY`` and one CORS
origin. A forced ``tool_choice`` is constrained by a JSON schema, so even this small model
answers with a call whose arguments validate.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import MODEL_NAME, Server, launch, running  # noqa: E402

KEY = "e2e-responses-key"
ORIGIN = "http://localhost:5173"
CITIES = ["Paris", "Rome", "London"]
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                  "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from engine.model_executor.checkpoint import resolve_checkpoint

    model_dir = resolve_checkpoint(None)
    saved = os.environ.get("ENGINE_API_KEY")
    os.environ["ENGINE_API_KEY"] = KEY  # the child inherits it; no --api-key on its command line
    try:
        srv = launch(model_dir, str(tmp_path_factory.mktemp("responses-e2e")), "--tool-call-parser", "hermes",
                     "--max-total-tokens", "8192", "--allowed-origins", ORIGIN, api_key=None)
    finally:
        if saved is None:
            os.environ.pop("ENGINE_API_KEY")
        else:
            os.environ["ENGINE_API_KEY"] = saved
    with running(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=600)


def test_key_from_the_environment_and_cors(server: Server) -> None:
    assert httpx.get(server.url + "/v1/models").status_code == 401
    preflight = httpx.options(server.url + "/v1/responses", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN


def test_agents_sdk_runs_an_agent_with_a_function_tool(server: Server) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 22 C in {city}."

    async def run() -> tuple[Any, Any]:
        async_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=600)
        model = OpenAIResponsesModel(model=MODEL_NAME, openai_client=async_client)
        settings = ModelSettings(tool_choice="get_weather", temperature=0.0, max_tokens=48)
        caller = Agent(name="weather", instructions="Answer questions about the weather in one sentence.",
                       tools=[get_weather], model=model, model_settings=settings, tool_use_behavior="stop_on_first_tool")
        # Then the conversation so far (function_call and function_call_output items) goes back in; with
        # tool_choice none the model answers in text (this small model would call again under auto).
        writer = caller.clone(model_settings=settings.resolve(ModelSettings(tool_choice="none")),
                              tool_use_behavior="run_llm_again")
        try:
            called = await Runner.run(caller, "What is the weather in Paris?", max_turns=2)
            # Streamed: the SDK reads the Responses events as they come.
            answered = Runner.run_streamed(writer, called.to_input_list() + [
                {"role": "user", "content": "Say it in one sentence."}], max_turns=2)
            kinds = {event.type async for event in answered.stream_events()}
            assert "raw_response_event" in kinds
            return called, answered
        finally:
            await async_client.close()

    called, answered = asyncio.run(run())
    assert len(calls) == 1 and calls[0].strip()
    assert [item.type for item in called.new_items] == ["tool_call_item", "tool_call_output_item"]
    assert called.final_output == f"It is sunny and 22 C in {calls[0]}."
    assert [item.type for item in answered.new_items] == ["message_output_item"]
    assert isinstance(answered.final_output, str) and answered.final_output.strip()


def test_responses_across_two_turns_whole_and_streamed(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, input="My name is Ann. Remember it.", max_output_tokens=16,
                                    temperature=0.0)
    assert first.status in ("completed", "incomplete") and first.output_text
    stream = client.responses.create(model=MODEL_NAME, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=16, temperature=0.0, stream=True)
    events = list(stream)
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    second = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == second.output_text
    # The second prompt held the first turn's input and output.
    assert first.usage and second.usage
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    structured = client.responses.create(model=MODEL_NAME, input="Pick a city.", max_output_tokens=24, text={
        "format": {"type": "json_schema", "name": "city", "schema": WEATHER_PARAMS, "strict": True}})
    assert json.loads(structured.output_text)["city"] in CITIES
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_missing")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL_NAME, input=[{"type": "computer_call_output", "call_id": "c",
                                                          "output": {}}])  # type: ignore[list-item]
    assert "input[0].type" in str(info.value)


def test_chat_request_with_every_client_field(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        max_completion_tokens=4, reasoning_effort="low", prompt_cache_key="k", safety_identifier="u",
        verbosity="low", modalities=["text"], prediction={"type": "content", "content": "yes"},
        web_search_options={}, store=False, metadata={"a": "b"}, service_tier="auto", user="me", seed=1,
        extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    streamed = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}, extra_body={"guided_json": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}})
    assert any(chunk.usage for chunk in streamed)


def test_streamed_named_tool_call_reassembles(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=32, stream=True)
    final_tool_calls: dict[int, Any] = {}
    for chunk in stream:  # the loop of OpenAI's function-calling guide
        for tool_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            index = tool_call.index
            if index not in final_tool_calls:
                final_tool_calls[index] = tool_call
            final_tool_calls[index].function.arguments += tool_call.function.arguments
    assert list(final_tool_calls) == [0] and final_tool_calls[0].function.name == "get_weather"
    assert json.loads(final_tool_calls[0].function.arguments)["city"] in CITIES


def test_langchain_on_the_responses_api(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model=MODEL_NAME, use_responses_api=True,  # type: ignore[arg-type]
                     max_tokens=16, temperature=0.0, max_retries=0)
    reply = llm.invoke("Say hello.")
    assert reply.text.strip() and reply.usage_metadata and reply.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.text for chunk in llm.stream("Say hello."))
    assert streamed == reply.text
