"""The expressions a program adds to its state: text, ``gen``, ``select``, chat roles.

They are plain descriptions; the state's executor runs them (``state.py``). A ``gen`` or
``select`` that is compared with a value (``if gen(choices=[...]) == "Yes":``) without being
added is evaluated against the running program's text so far, once, and not appended: see
``SglGen.__eq__``.
"""

from __future__ import annotations

import contextvars
import json
from typing import TYPE_CHECKING, Any

from engine_lang.choices import ChoicesMethod, resolve_method

if TYPE_CHECKING:
    from engine_lang.state import ProgramState

# The state of the program running in this thread (set by SglFunction.run): what an un-added
# gen/select is evaluated against when compared.
current_state: contextvars.ContextVar[ProgramState | None] = contextvars.ContextVar("engine_lang_state", default=None)

# Sampling fields gen() takes, by the native API's name; None means "the run's default".
SAMPLING_FIELDS = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
                   "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "regex",
                   "json_schema", "ebnf", "seed")
LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")

_DTYPE_REGEX = {int: r"[-+]?[0-9]+", "int": r"[-+]?[0-9]+", float: r"[-+]?[0-9]+(\.[0-9]+)?",
                "float": r"[-+]?[0-9]+(\.[0-9]+)?", bool: "(True|False)", "bool": "(True|False)"}


class SglExpr:
    """Base of everything ``s += ...`` takes besides strings; ``a + b`` makes a list."""

    def __add__(self, other: Any) -> SglExprList:
        return SglExprList([self, other])

    def __radd__(self, other: Any) -> SglExprList:
        return SglExprList([other, self])


class SglExprList(SglExpr):
    def __init__(self, items: list[Any]) -> None:
        self.items: list[Any] = []
        for item in items:
            self.items.extend(item.items if isinstance(item, SglExprList) else [item])

    def __repr__(self) -> str:
        return " + ".join(repr(i) for i in self.items)


class _Evaluated(SglExpr):
    """A gen/select that can be compared with a value inside a running program."""

    name: str | None
    _value: Any = None
    # The state it was evaluated in: compared again in the same run, it keeps its value.
    _evaluated_in: Any = None

    def value(self) -> Any:
        state = current_state.get()
        if state is None:
            raise RuntimeError(f"{self!r} was compared with a value outside a running program; add it to the "
                               "state (s += ...) and read s[name], or compare it inside an @function")
        if self._evaluated_in is not state:
            self._value = state.evaluate(self)
            self._evaluated_in = state
        return self._value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (str, int, float)):
            return bool(self.value() == other)
        return self is other

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = object.__hash__

    def __str__(self) -> str:
        return str(self.value())


class SglGen(_Evaluated):
    def __init__(self, name: str | None, sampling: dict[str, Any], logprobs: dict[str, Any]) -> None:
        self.name = name
        # Only what the call set: the run's defaults fill the rest.
        self.sampling = sampling
        self.logprobs = logprobs

    def __repr__(self) -> str:
        args = [repr(self.name)] if self.name else []
        args += [f"{k}={v!r}" for k, v in {**self.sampling, **self.logprobs}.items()]
        return f"gen({', '.join(args)})"


class SglSelect(_Evaluated):
    def __init__(self, name: str | None, choices: list[str], temperature: float, method: ChoicesMethod) -> None:
        self.name = name
        self.choices = choices
        self.temperature = temperature
        self.method = method

    def __repr__(self) -> str:
        head = f"{self.name!r}, " if self.name else ""
        return f"select({head}choices={self.choices!r}, choices_method={self.method.name!r})"


class SglRole(SglExpr):
    """A whole chat message: ``user("hi")``, ``assistant(gen("answer"))``."""

    def __init__(self, role: str, content: Any) -> None:
        self.role = role
        self.content = content

    def __repr__(self) -> str:
        return f"{self.role}({self.content!r})"


class RoleBegin(SglExpr):
    def __init__(self, role: str) -> None:
        self.role = role


class RoleEnd(SglExpr):
    def __init__(self, role: str) -> None:
        self.role = role


class VarScopeBegin(SglExpr):
    def __init__(self, name: str) -> None:
        self.name = name


class VarScopeEnd(SglExpr):
    def __init__(self, name: str) -> None:
        self.name = name


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | str | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    ebnf: str | None = None,
    seed: int | None = None,
    max_new_tokens: int | None = None,
) -> SglGen | SglSelect:
    """Generates text into variable ``name`` (SGLang's ``gen``); with ``choices`` it is ``select``.

    ``dtype`` (``int``, ``float``, ``bool``) constrains the output with a regular expression;
    ``regex``, ``json_schema`` and ``ebnf`` are the server's constrained decoding.
    """
    if choices is not None:
        return select(name, choices, temperature=temperature or 0.0, choices_method=choices_method)
    if max_tokens is not None and max_new_tokens is not None and max_tokens != max_new_tokens:
        raise ValueError(f"gen({name!r}): max_tokens={max_tokens} contradicts max_new_tokens={max_new_tokens}")
    if dtype is not None:
        if dtype not in _DTYPE_REGEX and dtype not in (str, "str"):
            raise ValueError(f"gen({name!r}): dtype {dtype!r} is not supported; accepted: int, float, bool, str")
        if regex is None and dtype in _DTYPE_REGEX:
            regex = _DTYPE_REGEX[dtype]
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    values = {"max_new_tokens": max_tokens if max_tokens is not None else max_new_tokens,
              "min_new_tokens": min_tokens, "stop": stop, "stop_token_ids": stop_token_ids,
              "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
              "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
              "repetition_penalty": repetition_penalty, "ignore_eos": ignore_eos, "regex": regex,
              "json_schema": json_schema, "ebnf": ebnf, "seed": seed}
    logprobs = {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                "top_logprobs_num": top_logprobs_num, "return_text_in_logprobs": return_text_in_logprobs}
    return SglGen(name, {k: v for k, v in values.items() if v is not None},
                  {k: v for k, v in logprobs.items() if v is not None})


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesMethod | str | None = None) -> SglSelect:
    """Appends the choice the model scores best (one batched scoring request, no sampling).

    ``temperature`` 0 picks the best score; above 0 a choice is drawn with probability
    proportional to ``exp(score / temperature)``.
    """
    if not choices or not isinstance(choices, (list, tuple)) or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"select({name!r}): choices must be a non-empty list of strings, got {choices!r}")
    if temperature < 0:
        raise ValueError(f"select({name!r}): temperature {temperature} is negative; accepted: >= 0")
    return SglSelect(name, list(choices), temperature, resolve_method(choices_method))


def system(content: Any = None) -> SglRole:
    return SglRole("system", content)


def user(content: Any = None) -> SglRole:
    return SglRole("user", content)


def assistant(content: Any = None) -> SglRole:
    return SglRole("assistant", content)
