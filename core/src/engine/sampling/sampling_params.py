"""Per-request sampling parameters (SGLang's names), validated with clear errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError, did_you_mean

_TOP_K_ALL = -1


class SamplingParamsError(EngineError):
    """A sampling parameter has an invalid value; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = _TOP_K_ALL  # -1 = whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings (scheduler ends, detokenizer cuts)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the output
    n: int = 1
    seed: int | None = None
    # Structured output (at most one of the four; see docs/structured_output.md). ``json_schema``
    # is a JSON Schema as a JSON string (a dict is serialized); ``regex`` a regular expression;
    # ``ebnf`` an EBNF/GBNF grammar (root rule ``root``); ``structural_tag`` xgrammar's
    # structural-tag JSON.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # token id -> bias added to its logit (OpenAI's logit_bias; values in [-100, 100]).
    logit_bias: dict[int, float] | None = None

    FIELDS = (
        "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids",
        "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "seed",
        "json_schema", "regex", "ebnf", "structural_tag", "logit_bias",
    )
    GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Builds and validates; unknown keys are an error with a suggestion."""
        d = dict(d or {})
        for key in d:
            if key not in cls.FIELDS:
                raise SamplingParamsError(key, f"unknown sampling parameter '{key}'{did_you_mean(key, cls.FIELDS)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("stop") is None:
            d.pop("stop", None)
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        for key in ("json_schema", "structural_tag"):
            if isinstance(d.get(key), (dict, list)):
                d[key] = json.dumps(d[key])
        if isinstance(d.get("logit_bias"), dict):
            d["logit_bias"] = _token_keys(d["logit_bias"])
        params = cls(**d)
        params.validate()
        return params

    def validate(self) -> None:
        def bad(name: str, accepted: str) -> SamplingParamsError:
            return SamplingParamsError(name, f"sampling parameter '{name}': invalid value {getattr(self, name)!r}; accepted: {accepted}")

        def num(name: str, integer: bool = False) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
                raise bad(name, "an integer" if integer else "a number")
            return v

        if num("max_new_tokens", True) < 0:
            raise bad("max_new_tokens", "an integer >= 0")
        if num("min_new_tokens", True) < 0 or self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", "an integer between 0 and max_new_tokens")
        if num("temperature") < 0:
            raise bad("temperature", "a number >= 0")
        if not 0.0 < num("top_p") <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if num("top_k", True) == 0 or self.top_k < _TOP_K_ALL:
            raise bad("top_k", "-1 (all) or an integer >= 1")
        if not 0.0 <= num("min_p") <= 1.0:
            raise bad("min_p", "a number in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= num(name) <= 2.0:
                raise bad(name, "a number in [-2, 2]")
        if not 0.0 < num("repetition_penalty") <= 2.0:
            raise bad("repetition_penalty", "a number in (0, 2]")
        if num("n", True) < 1:
            raise bad("n", "an integer >= 1")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "an integer")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "a list of token ids (integers >= 0)")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        given = [name for name in self.GRAMMAR_FIELDS if getattr(self, name) is not None]
        for name in given:
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise bad(name, "a non-empty string")
        if len(given) > 1:
            raise SamplingParamsError(given[1], f"sampling parameters {' and '.join(given)} were both given; "
                                                f"at most one of {', '.join(self.GRAMMAR_FIELDS)} may be set")
        for name in ("json_schema", "structural_tag"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                raise SamplingParamsError(name, f"sampling parameter '{name}': not valid JSON: {exc}") from None
            if not isinstance(parsed, (dict, bool)):
                raise SamplingParamsError(name, f"sampling parameter '{name}': must be a JSON object, got {type(parsed).__name__}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                and isinstance(b, (int, float)) and not isinstance(b, bool) and -100.0 <= b <= 100.0
                for t, b in self.logit_bias.items()
            ):
                raise bad("logit_bias", "a map of token ids (integers >= 0) to numbers in [-100, 100]")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the structured-output constraint, or None: kind is one of
        ``json_schema``, ``regex``, ``ebnf``, ``structural_tag``."""
        for name in self.GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.FIELDS}


def _token_keys(bias: dict[Any, Any]) -> dict[Any, Any]:
    """JSON object keys are strings: ``{"50256": -100}`` -> ``{50256: -100}``; a key that is no
    integer is kept as is for ``validate`` to reject."""
    out: dict[Any, Any] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        out[key] = value
    return out
