"""Stop strings in the scheduler: a request ends at the step whose token completes one.

The detokenizer cuts the text at the stop string, but it sees a non-streaming request's tokens
only once the scheduler finishes it, so the scheduler must find the match itself. Each request
with stop strings decodes its output here exactly as the detokenizer will (the same incremental
decoder, prompt context and flags, the same matcher), one check per appended token, so both
processes agree on the token that ends the request and the text it ends with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.managers.incremental_detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.managers.tokenizer_utils import shared_tokenizer

if TYPE_CHECKING:
    from engine.sampling.sampling_params import SamplingParams

# Prompt tokens sent with a request's first output message as the detokenizer's decoding context.
PROMPT_TAIL_TOKENS = 16


def prompt_tail(input_ids: list[int]) -> list[int]:
    """The prompt tokens both decoders take as the context of the first output token."""
    return input_ids[-PROMPT_TAIL_TOKENS:]


class StopStringCheck:
    """One request's output text, decoded token by token, searched for its stop strings."""

    def __init__(self, tokenizer: Any, params: SamplingParams, input_ids: list[int]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_tail(input_ids), params.skip_special_tokens,
                                             params.spaces_between_special_tokens)
        self._matcher = StopStringMatcher(params.stop)
        # Output tokens already decoded (a retracted request keeps its output and this state).
        self._fed = 0
        # The text's last max_stop_len - 1 characters: all a match completed later can reach back.
        self._tail = ""

    def feed(self, output_ids: list[int]) -> str | None:
        """Decodes the tokens appended since the last call; returns the stop string their text
        completes (the first to end, as the detokenizer picks it), else None."""
        new = output_ids[self._fed:]
        self._fed = len(output_ids)
        if not new:
            return None
        new_text = self._detok.add_tokens(new)
        if not new_text:
            return None  # an incomplete character: no text yet, no match
        text = self._tail + new_text
        matched, _ = self._matcher.feed(text, len(self._tail))
        keep = self._matcher.max_stop_len - 1
        self._tail = text[-keep:] if keep else ""
        return self._matcher.matched if matched else None


def stop_string_check(params: SamplingParams, input_ids: list[int], tokenizer_path: str | None,
                      trust_remote_code: bool = False) -> StopStringCheck | None:
    """The check for a request with stop strings; None without stop strings or without a
    tokenizer (--skip-tokenizer-init: outputs are ids, no text to match). The tokenizer is the
    process's shared one (a server's grammar backend loads it at start-up; else the first request
    with stop strings does)."""
    if not params.stop or tokenizer_path is None:
        return None
    return StopStringCheck(shared_tokenizer(tokenizer_path, trust_remote_code), params, input_ids)
