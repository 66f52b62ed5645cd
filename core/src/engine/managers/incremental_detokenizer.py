"""Per-request incremental detokenization and stop-string matching (detokenizer process).

Decoding only the tail each step uses SGLang's two-offset window over the token ids:

    ids:  ... | surr_offset ........ read_offset ........ end
                \\_ context, already emitted _/ \\_ new tokens _/

Each step decodes ``ids[surr_offset:]`` and ``ids[surr_offset:read_offset]`` and emits the text
the new tokens add. The context tokens make the new tokens decode as they would inside the full
sequence (SentencePiece's leading-space rule, byte-fallback and byte-level tokens that together
form one character). Text that ends in U+FFFD is an incomplete UTF-8 sequence and is held back
until the next token completes it.
"""

from __future__ import annotations

from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens give the first output token its context; 5 as in SGLang and vLLM.
PROMPT_CONTEXT_TOKENS = 5


class DecodingTokenizer(Protocol):
    """The one tokenizer method used (satisfied by any transformers tokenizer)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: Any) -> str:
        """Turn token ids into text."""
        ...


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a few tokens at a time.

    The concatenation of everything returned by ``add_tokens`` and ``flush`` equals
    ``tokenizer.decode(output_ids)`` (with the same flags) whenever the output is valid UTF-8;
    with ``prompt_ids`` the first tokens are decoded in the prompt's context instead, so a
    SentencePiece output that starts with "▁Paris" yields " Paris", as it reads after the prompt.
    """

    def __init__(
        self,
        tokenizer: DecodingTokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_kwargs: dict[str, Any] = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        # All text emitted so far (the streamed text, before any stop-string cut).
        self.output_text = ""
        # All output ids given to add_tokens, without the prompt.
        self.output_ids: list[int] = []
        # ids[surr_offset:]; tokens before surr_offset are no longer needed and are dropped, so
        # offsets below are relative to this list and it stays a few tokens long.
        self._window: list[int] = self._prompt_context(prompt_ids or [])
        self._read_offset = len(self._window)
        # decode(self._window[:self._read_offset]), kept from the previous step.
        self._surr_text = self._decode(self._window)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._decode_kwargs) if ids else ""

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The last few prompt tokens, extended back until they decode to some text."""
        start = max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS)
        # A context that decodes to "" (e.g. only skipped special tokens) would let the decoder
        # treat the first output token as the start of the text and strip its leading space.
        while start > 0 and not self._decode(prompt_ids[start:]):
            start = max(0, start - PROMPT_CONTEXT_TOKENS)
        context = prompt_ids[start:]
        # A prompt ending inside a multi-byte character cannot serve as a stable prefix: the
        # first output token would change the last context character.
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def add_tokens(self, new_ids: list[int]) -> str:
        """Append output tokens; return the text they finalise ("" while a char is incomplete)."""
        self.output_ids.extend(new_ids)
        self._window.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At finish, return whatever is still pending, even an incomplete character (as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._window):
            return ""
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        new_text = text[len(self._surr_text) :]
        pending = self._window[self._read_offset :]
        pending_text = self._decode(pending)
        # Slide the window only onto tokens that decode to some text: otherwise the decoder's
        # start-of-text rules (SentencePiece dropping the first "▁", a Strip decoder, skipped
        # special tokens) would apply to the next tokens and differ from the full decode.
        if pending_text:
            self._window = pending
            self._surr_text = pending_text
        else:
            self._surr_text = text
        self._read_offset = len(self._window)
        self.output_text += new_text
        return new_text


class StopStringMatcher:
    """Finds stop strings in a growing text and says how much of it is safe to stream.

    Call ``feed`` after every piece of new text: a stop string is found as soon as it is complete,
    including one spanning several pieces. When several complete in the same piece, the one that
    ends first wins (ties: the longer one), which is what a piece-by-piece stream would have seen,
    so the result does not depend on how the text was split into pieces.
    """

    def __init__(self, stop: list[str], include_stop: bool = False) -> None:
        empty = [i for i, s in enumerate(stop) if not s]
        if empty:
            raise ValueError(
                f"stop strings must be non-empty; got '' at index {empty[0]} of {stop!r}"
            )
        # dict.fromkeys: de-duplicate while keeping the caller's order.
        self.stop: list[str] = list(dict.fromkeys(stop))
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # The stop string found by the last successful feed (for the finish reason), else None.
        self.matched: str | None = None

    def feed(self, text_so_far: str, new_text_start: int) -> tuple[bool, int]:
        """Look for a stop string that ends in the new text ``text_so_far[new_text_start:]``.

        Returns:
            ``(True, cut)`` when a stop string matched: the final text is ``text_so_far[:cut]``
            (the cut is before the stop string, or after it with ``include_stop``);
            ``(False, len(text_so_far))`` otherwise.
        """
        # A match may begin up to max_stop_len - 1 characters before the new text.
        search_from = max(0, new_text_start - self.max_stop_len + 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop) of the winning match
        for s in self.stop:
            start = text_so_far.find(s, search_from)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return False, len(text_so_far)
        end, start, self.matched = best
        return True, end if self.include_stop else start

    def holdback(self, text_so_far: str) -> int:
        """How many trailing characters could begin a stop string and must not be streamed yet."""
        longest = 0
        for s in self.stop:
            # Proper prefixes only: a complete stop string is feed's business.
            for k in range(min(len(s) - 1, len(text_so_far)), longest, -1):
                if text_so_far.endswith(s[:k]):
                    longest = k
                    break
        return longest
