"""ThinkTagReasoningParser in both styles, and the combined chat-output reader."""

from __future__ import annotations

from engine.parsers import ChatOutputParser, ThinkTagReasoningParser, ToolCall
from engine.parsers.forced import NamedCallParser


class ModelOpens(ThinkTagReasoningParser):
    starts_in_reasoning = False


class TemplateOpens(ThinkTagReasoningParser):
    starts_in_reasoning = True


def test_styles() -> None:
    assert ModelOpens().parse("<think>\nhmm\n</think>\n\nHi") == ("hmm", "Hi")
    assert ModelOpens().parse("Hi <think>") == ("", "Hi <think>")
    assert TemplateOpens().parse("hmm</think>Hi") == ("hmm", "Hi")
    assert TemplateOpens().parse("still thinking") == ("still thinking", "")


def test_stream_holds_back_partial_tags() -> None:
    stream = ModelOpens().stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>a b </th") == ("a b", "")
    assert stream.feed("ink>\n\nAnswer", final=True) == ("", "Answer")


def test_chat_output_reads_calls_after_the_reasoning() -> None:
    from engine_toolparser_hermes.parser import HermesToolCallParser

    reader = ChatOutputParser(ModelOpens(), HermesToolCallParser(), max_calls=1)
    out = reader.parse('<think>call it</think>\n<tool_call>{"name": "a", "arguments": {}}</tool_call>'
                       '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert (out.reasoning, out.content, out.calls) == ("call it", "", [ToolCall("a", "{}")])
    stream = reader.stream()
    deltas = [stream.feed(p) for p in ("<think>call", " it</think>\n<tool_call>{\"name\": \"a\"", ", \"arguments\": {}}")]
    deltas.append(stream.feed('</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>', final=True))
    assert "".join(d.reasoning for d in deltas) == "call it"
    assert [c.name for d in deltas for c in d.calls if c.name] == ["a"] and stream.called


def test_named_call_is_announced_at_once() -> None:
    stream = ChatOutputParser(None, NamedCallParser("f")).stream()
    first = stream.feed("")
    assert [(c.name, c.arguments) for c in first.calls] == [("f", "")]
    assert [c.arguments for c in stream.feed('{"x": 1}', final=True).calls] == ['{"x": 1}']
