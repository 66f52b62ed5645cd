"""Chat roles rendered through the model's own Jinja chat template, as transformers renders it.

A program builds its prompt one role at a time (``s += user("hi")``, then ``s += assistant(gen())``),
so each role needs the text that opens it and the text that closes it. Both come from the template
itself: rendering the conversation with one more message whose content is a marker splits that
message's text into what comes before the content (the opening) and after it (the closing). A
template that renders a conversation's start differently once more messages follow (not
incremental) cannot be built up this way and is refused with an error naming the role.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

# The default model's template (SmolLM2-135M-Instruct's ChatML): used where a backend cannot ask
# the server for its own (an OpenAI-compatible server that is not this engine).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_MARKER = "\x00ENGINE_LANG_CONTENT\x00"


def _raise_exception(message: str) -> None:
    raise ValueError(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers replaces jinja's tojson (which escapes HTML) with plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@dataclass
class ChatTemplate:
    """A model's chat template and the special tokens its text may refer to (``bos_token``...)."""

    # The Jinja source, as ``tokenizer.chat_template``.
    source: str
    # ``tokenizer.special_tokens_map`` (string values): transformers passes them to the template.
    special_tokens: dict[str, str] = field(default_factory=dict)

    @cached_property
    def _compiled(self) -> Any:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The environment transformers' apply_chat_template uses, so the text is the same.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation's text, as ``apply_chat_template(messages, tokenize=False)``."""
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)

    def role_begin(self, messages: list[dict[str, Any]], role: str) -> str:
        """The text that opens a ``role`` message after ``messages``."""
        before, _ = self._split(messages, role)
        return before

    def role_end(self, messages: list[dict[str, Any]], role: str, content: str) -> str:
        """The text that closes a ``role`` message with ``content`` after ``messages``."""
        done = self.render(messages)
        full = self.render([*messages, {"role": role, "content": content}])
        begin = self.role_begin(messages, role)
        head = done + begin + content
        if not full.startswith(head):
            raise ValueError(f"{role}(): the chat template renders this message's content differently from the "
                             "text the program built (it rewrites content, e.g. strips it); build this "
                             "conversation with the messages API instead")
        return full[len(head):]

    def _split(self, messages: list[dict[str, Any]], role: str) -> tuple[str, str]:
        done = self.render(messages)
        full = self.render([*messages, {"role": role, "content": _MARKER}])
        if full.count(_MARKER) != 1 or not full.startswith(done):
            raise ValueError(f"{role}(): the chat template is not incremental (the conversation so far renders "
                             "differently once this message follows it), so roles cannot be added one at a time")
        before, after = full[len(done):].split(_MARKER)
        return before, after
