"""The engine's logprob lists in OpenAI's two formats.

The engine reports ``[(logprob, token_id)]`` per position and, per position,
the top alternatives ``[(logprob, token_id)] * k``. Chat wants
``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``; legacy
completions want parallel lists ``tokens / token_logprobs / top_logprobs /
text_offset``. Prompt positions (``echo``) start with a token that has no logprob.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

TokenText = Callable[[int], str]
Entry = Sequence[Any]  # (logprob | None, token_id)

# JSON has no -Infinity; a token the sampler could not pick gets this instead (as vLLM does).
_FLOOR = -9999.0


def _finite(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else _FLOOR


def chat_logprobs(entries: Sequence[Entry], tops: Sequence[Sequence[Entry]], token_text: TokenText,
                  top_n: int) -> dict[str, Any]:
    """``choice.logprobs`` of a chat completion (or of one streamed chunk)."""
    content = []
    for i, (logprob, token_id) in enumerate(entries):
        text = token_text(token_id)
        alternatives = tops[i] if i < len(tops) and top_n > 0 else []
        content.append({
            "token": text,
            "logprob": _finite(logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": token_text(t), "logprob": _finite(lp),
                              "bytes": list(token_text(t).encode("utf-8"))} for lp, t in alternatives[:top_n]],
        })
    return {"content": content}


def completion_logprobs(entries: Sequence[Entry], tops: Sequence[Sequence[Entry]] | None, token_text: TokenText,
                        top_n: int, text_offset: int) -> dict[str, Any]:
    """Legacy ``choice.logprobs``; ``text_offset`` is where the first token starts in the choice's text."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for i, (logprob, token_id) in enumerate(entries):
        text = token_text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(logprob))
        if logprob is None:
            out["top_logprobs"].append(None)  # the prompt's first token: nothing predicts it
        else:
            alternatives = tops[i] if tops is not None and i < len(tops) else []
            out["top_logprobs"].append({token_text(t): _finite(lp) for lp, t in alternatives[:top_n]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Concatenates legacy logprob blocks (echoed prompt, then output)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key].extend(part[key])
    return out


def native_logprobs(entries: Sequence[Entry] | None, token_text: TokenText | None) -> list[list[Any]] | None:
    """SGLang's ``[logprob, token_id, text_or_null]`` triples for ``/generate``."""
    if entries is None:
        return None
    return [[_finite(lp), t, token_text(t) if token_text else None] for lp, t in entries]


def native_top_logprobs(tops: Sequence[Sequence[Entry] | None] | None,
                        token_text: TokenText | None) -> list[Any] | None:
    if tops is None:
        return None
    return [None if top is None else native_logprobs(top, token_text) for top in tops]
