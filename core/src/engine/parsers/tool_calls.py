"""Tool-call parsers: the interface plugins implement, and the streaming built on it.

A parser turns a model's output in one tool-call format (Hermes ``<tool_call>{json}</tool_call>``,
Llama 3 JSON, Mistral ``[TOOL_CALLS]``...) into normal text and calls. It implements one
method, ``parse_partial(text, final)``: the content and calls as far as ``text`` goes, holding
back whatever may still change meaning. Non-streamed parsing is ``parse_partial(text, True)``;
streaming (``ToolCallStream``) re-runs it after each piece and sends what grew, as OpenAI
tool-call deltas. A plugin registers ``ToolCallParserSpec(name, factory)``, where
``factory(options=...)`` returns a ``ToolCallParser``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.parsers.scan import MalformedJSON, ObjectScan, scan_object, scan_value, skip_ws
from engine.parsers.stream import GrowingText, ParserStreamError


@dataclass(frozen=True)
class ToolCall:
    """A finished call: OpenAI's ``function.name`` and ``function.arguments`` (JSON text)."""

    name: str
    arguments: str


@dataclass
class PartialToolCall:
    """A call as far as the output goes."""

    #: None until the function's name is complete (a stream announces a call only then).
    name: str | None
    #: the arguments' JSON text so far; only ever grows as the output does.
    arguments: str = ""
    #: the call's text has ended (its arguments are final).
    complete: bool = False


@dataclass
class ToolCallParse:
    """What a parser read from (part of) an output."""

    #: normal text, the tool-call markup removed.
    content: str
    calls: list[PartialToolCall] = field(default_factory=list)


class ToolCallParser:
    """Base class of tool-call parsers; subclasses implement ``parse_partial`` and ``render_calls``.

    Args:
        options: the plugin's options (``plugin_options``), declared defaults overridden.
    """

    #: The format uses special tokens (Mistral's ``[TOOL_CALLS]``): requests with tools are
    #: detokenized with ``skip_special_tokens=False`` so the parser sees them.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    def parse_partial(self, text: str, final: bool) -> ToolCallParse:
        """Content and calls in ``text``, the output so far (``final``: all of it).

        Must be prefix-stable: for a longer text the content and each call's arguments extend
        what was returned before, calls keep their order, and a call once named keeps its
        name. Hold back text that may still become markup (the start of a tag), and a call
        until its name is complete. With ``final``, hold nothing back: a call cut off by the
        token limit is still a call (as OpenAI returns it, with ``finish_reason: length``).
        """
        raise NotImplementedError

    def render_calls(self, calls: list[ToolCall]) -> str:
        """``calls`` written in this format, as the model would write them. Used for assistant
        messages with ``tool_calls`` when the chat template cannot render them; and by the
        conformance kit: ``parse(render_calls(calls))`` must give the calls back."""
        raise NotImplementedError

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        """System-prompt text describing ``tools`` (OpenAI tool dicts) and how to call them in
        this format; added when the chat template ignores ``tools``."""
        return default_tool_prompt(tools, self.render_calls([ToolCall("<function-name>", '{"<arg>": "<value>"}')]))

    def new_call_id(self) -> str:
        """The id a call gets in the response (OpenAI's ``call_...``)."""
        return f"call_{secrets.token_hex(12)}"

    # -- built on parse_partial ------------------------------------------------
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        result = self.parse_partial(text, final=True)
        return result.content, [ToolCall(c.name, c.arguments or "{}") for c in result.calls if c.name is not None]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def default_tool_prompt(tools: list[dict[str, Any]], example: str) -> str:
    """Tools as JSON lines, then how to call one (``example``: a call in the parser's format)."""
    lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return ("You can call the functions described below, one JSON object per line:\n"
            f"{lines}\n\n"
            "To call a function, reply with the call and nothing else, written exactly like this:\n"
            f"{example}")


@dataclass
class ToolCallDelta:
    """One call's piece of a streamed chunk (OpenAI ``delta.tool_calls[i]``)."""

    index: int
    #: set on a call's first delta only, with ``name``.
    id: str | None
    name: str | None
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


class ToolCallStream:
    """Feeds an output piece by piece; returns new content and tool-call deltas."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.content = GrowingText("content")
        # per call: its id (set when its name is sent) and its arguments sent so far
        self.ids: list[str] = []
        self.names: list[str] = []
        self.arguments: list[GrowingText] = []

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(new content, call deltas) after ``piece``; ``final`` for the last piece."""
        self.text += piece
        parsed = self.parser.parse_partial(self.text, final)
        content = self.content.advance(parsed.content)
        deltas = []
        for index, call in enumerate(parsed.calls):
            if index < len(self.ids):
                if call.name != self.names[index]:
                    raise ParserStreamError(f"call {index} was streamed as {self.names[index]!r}, "
                                            f"then named {call.name!r}")
                more = self.arguments[index].advance(call.arguments)
                if more:
                    deltas.append(ToolCallDelta(index, None, None, more))
                continue
            if call.name is None:
                break  # not announced yet: later calls wait for it
            self.ids.append(self.parser.new_call_id())
            self.names.append(call.name)
            self.arguments.append(GrowingText(f"the arguments of call {index}"))
            deltas.append(ToolCallDelta(index, self.ids[-1], call.name, self.arguments[-1].advance(call.arguments)))
        if len(parsed.calls) < len(self.ids):
            raise ParserStreamError(f"{len(self.ids)} calls were streamed, then the parser found {len(parsed.calls)}")
        return content, deltas


# -- helpers for JSON call formats -------------------------------------------------------
NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


def scan_call_object(text: str, i: int, final: bool, name_keys: tuple[str, ...] = NAME_KEYS,
                     argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> tuple[PartialToolCall | None, int | None]:
    """The call in the JSON object at ``text[i] == '{'``: ``(call, end)``.

    ``call`` is None when the object is not a call (it ended, or broke off, without a string
    name); ``end`` is where the object ends (None while incomplete). A call whose JSON breaks
    after its name is kept, complete, with the arguments read so far. Arguments given as a
    JSON string (some models encode them) are decoded once complete.
    """
    obj = scan_object(text, i, final)
    name = _string_member(text, obj, name_keys)
    if name is False:
        return None, obj.end
    done = obj.end is not None or obj.malformed or final
    if name is None and done:
        return None, obj.end
    args = obj.get(*argument_keys)
    arguments = ""
    if args is not None:
        raw = text[args.start:args.end] if args.end is not None else text[args.start:].rstrip()
        if raw.startswith('"'):  # encoded as a string: usable only once complete
            arguments = _decode_string(raw) if args.end is not None else ""
        else:
            arguments = raw
    elif done:
        arguments = "{}"
    return PartialToolCall(name if isinstance(name, str) else None, arguments, done), obj.end


def _string_member(text: str, obj: ObjectScan, keys: tuple[str, ...]) -> str | None | bool:
    """The member's string value; None while absent or incomplete; False if it is no string."""
    member = obj.get(*keys)
    if member is None or member.end is None:
        return None
    try:
        value = json.loads(text[member.start:member.end])
    except ValueError:
        return False
    return value if isinstance(value, str) and value else False


def _decode_string(raw: str) -> str:
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw


def scan_call_array(text: str, i: int, final: bool, argument_keys: tuple[str, ...] = ARGUMENT_KEYS
                    ) -> tuple[list[PartialToolCall], int | None, bool]:
    """The calls in the JSON array at ``text[i] == '['``: ``(calls, end, valid)``.

    ``end`` is where the array ends (None while incomplete); ``valid`` is False when an
    element is not a call object (the calls before it are kept).
    """
    n, calls = len(text), []
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return calls, None, True
        if text[j] == "]":
            return calls, j + 1, True
        if text[j] == "," and calls:
            j += 1
            continue
        if text[j] != "{":
            return calls, None, False
        call, end = scan_call_object(text, j, final, argument_keys=argument_keys)
        if call is None:
            return calls, None, False
        calls.append(call)
        if end is None:
            return calls, None, True
        j = end


def scan_json_value(text: str, i: int, final: bool) -> tuple[str, int | None]:
    """The JSON value at ``i`` as far as it goes: (its text, right-stripped; its end or None)."""
    try:
        end = scan_value(text, i, final)
    except MalformedJSON:
        return text[i:].rstrip(), len(text)
    return (text[i:end] if end is not None else text[i:].rstrip()), end
