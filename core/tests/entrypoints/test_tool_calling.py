"""Tool fields of chat requests: validation (400s naming the field), prompt rendering for
templates with and without tool support, sampling additions, and --tool-call-parser checks."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from engine.config import ServerArgs
from engine.entrypoints.http.context import chat_message_dict
from engine.entrypoints.http.errors import APIError
from engine.entrypoints.http.protocol import ChatCompletionRequest
from engine.entrypoints.http.tool_calling import ToolPlan, finish_reason, plan_tools, template_messages
from engine.errors import PluginError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _req(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": ""}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
])
def test_bad_tool_fields_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(_req(**body))
    assert info.value.status == 400 and info.value.param == param, info.value


def test_plans() -> None:
    assert plan_tools(_req()).mode == "none"
    assert plan_tools(_req(tools=[WEATHER])).mode == "auto"
    plan = plan_tools(_req(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                           parallel_tool_calls=False))
    assert (plan.mode, plan.named, plan.parallel, plan.forced) == ("named", "get_weather", False, True)
    params = plan.sampling({"max_new_tokens": 5}, None)
    assert json.loads(params["json_schema"]) == WEATHER["function"]["parameters"]
    required = plan_tools(_req(tools=[WEATHER], tool_choice="required")).sampling({}, None)
    assert json.loads(required["json_schema"])["type"] == "array"
    with pytest.raises(APIError) as info:
        plan.sampling({"json_schema": "{}"}, None)
    assert info.value.param == "tool_choice"
    assert finish_reason("stop", plan_tools(_req(tools=[WEATHER])), called=True) == "tool_calls"
    assert finish_reason("stop", plan, called=True) == "stop"  # a named choice stops, as OpenAI's does
    assert finish_reason("length", plan_tools(_req(tools=[WEATHER])), called=True) == "length"


@pytest.mark.parametrize("grammar, named", [
    ({"json_schema": '{"type": "object"}'}, "response_format"),
    ({"structural_tag": "{}"}, "response_format"),
    ({"regex": "[0-9]+"}, "regex"),
    ({"ebnf": 'root ::= "x"'}, "ebnf"),
])
def test_auto_tools_with_a_parser_and_a_grammar_are_refused(grammar: dict[str, str], named: str) -> None:
    """The grammar would keep the model from writing the markup the parser reads calls from:
    the combination is a 400 naming tool_choice and the grammar's field, not calls lost silently."""
    from engine.parsers import ToolCallParser

    for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        with pytest.raises(APIError) as info:
            plan_tools(_req(**body)).sampling(dict(grammar), ToolCallParser())
        assert info.value.status == 400 and info.value.param == "tool_choice", info.value
        assert f"tool_choice: 'auto' (the default with tools)" in str(info.value) and named in str(info.value)
    # tool_choice none keeps the tools in the prompt and the grammar; no parser: the text is returned.
    assert plan_tools(_req(tools=[WEATHER], tool_choice="none")).sampling(dict(grammar), ToolCallParser()) == grammar
    assert plan_tools(_req(tools=[WEATHER])).sampling(dict(grammar), None) == grammar


def test_mistral_parser_keeps_special_tokens_for_auto_only() -> None:
    from engine_toolparser_mistral.parser import MistralToolCallParser

    assert plan_tools(_req(tools=[WEATHER])).sampling({}, MistralToolCallParser())["skip_special_tokens"] is False
    assert "skip_special_tokens" not in plan_tools(_req(tools=[WEATHER], tool_choice="required")).sampling({}, MistralToolCallParser())


def _messages() -> list[dict[str, Any]]:
    req = _req(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ])
    return [chat_message_dict(m, i) for i, m in enumerate(req.messages)]


def test_messages_for_a_template_that_renders_tools() -> None:
    tokenizer = SimpleNamespace(chat_template="{% for t in tools %}{% endfor %}{{ m.tool_calls }}")
    conversation, kwargs = template_messages(_messages(), plan_tools(_req(tools=[WEATHER])), tokenizer, None)
    assert kwargs == {"tools": [WEATHER]}
    assert conversation[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # decoded for the template
    assert conversation[3] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}


def test_messages_for_a_template_that_ignores_tools() -> None:
    from engine_toolparser_hermes.parser import HermesToolCallParser

    tokenizer = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    conversation, kwargs = template_messages(_messages(), plan_tools(_req(tools=[WEATHER])), tokenizer,
                                             HermesToolCallParser())
    assert kwargs == {}
    system = conversation[0]["content"]
    assert system.startswith("Be brief.\n\n") and "<tools>" in system and "get_weather" in system
    assert "tool_calls" not in conversation[2]
    assert conversation[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # no system message: one is added; tool_choice none leaves the prompt alone
    first_user = _messages()[1:2]
    added, _ = template_messages(first_user, plan_tools(_req(tools=[WEATHER], tool_choice="required")), tokenizer, None)
    assert added[0]["role"] == "system" and '"parameters"' in added[0]["content"]
    untouched, _ = template_messages(first_user, plan_tools(_req(tools=[WEATHER], tool_choice="none")), tokenizer, None)
    assert untouched == first_user
    assert template_messages(first_user, ToolPlan(), tokenizer, None) == (first_user, {})


def test_bad_assistant_tool_calls() -> None:
    req = _req(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(APIError) as info:
        chat_message_dict(req.messages[0], 0)
    assert info.value.param == "messages[0].tool_calls[0].function.arguments"


def test_unknown_parser_names_are_errors_naming_the_flag() -> None:
    with pytest.raises(PluginError, match=r"--tool-call-parser: unknown tool-call parser 'hermse'; installed: .*hermes.*did you mean hermes"):
        ServerArgs(tool_call_parser="hermse").validate()
    with pytest.raises(PluginError, match=r"--reasoning-parser: unknown reasoning parser 'r1'; installed: deepseek-r1, qwen3"):
        ServerArgs(reasoning_parser="r1").validate()
    ServerArgs(tool_call_parser="hermes", reasoning_parser="qwen3").validate()
