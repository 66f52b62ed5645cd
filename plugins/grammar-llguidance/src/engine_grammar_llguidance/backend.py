"""llguidance behind ``engine.constrained.GrammarBackend``.

llguidance has no compiled-grammar object separate from its matcher: ``compile`` builds a
matcher at the grammar's start (the expensive part: lexer and parser tables) and every
request's matcher is a deep copy of it.
"""

from __future__ import annotations

import threading
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from engine.constrained import GrammarBackend, GrammarError, GrammarKey, GrammarMatcher, TokenizerInfo


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self._stop = stop_token_ids
        self._terminated = False
        # Tokens consumed, so a rollback over the stop token clears ``_terminated``.
        self._consumed: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._stop and self._m.is_accepting():
            # A complete match takes a stop token (try_consume_tokens refuses it once stopped).
            ok = self._m.consume_token(token_id)
        else:
            # try_consume_tokens leaves the matcher usable when the token is refused
            # (consume_token would put it in a permanent error state).
            ok = self._m.try_consume_tokens([token_id]) == 1
        if not ok:
            return False
        self._consumed.append(token_id)
        if token_id in self._stop:
            self._terminated = True
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        undone = self._consumed[-num_tokens:]
        # llguidance keeps no history entry for the stop token that ends a complete match.
        ended = 1 if self._terminated else 0
        if len(undone) - ended:
            self._m.rollback(len(undone) - ended)
        del self._consumed[-num_tokens:]
        self._terminated = bool(self._consumed) and self._consumed[-1] in self._stop

    def copy(self) -> LLGuidanceMatcher:
        twin = LLGuidanceMatcher(self._m.deep_copy(), self._stop)
        twin._terminated, twin._consumed = self._terminated, list(self._consumed)
        return twin


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer_info: TokenizerInfo, options: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer_info)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                info = self.tokenizer_info
                stops = list(info.stop_token_ids) or None
                self._tokenizer = llguidance.hf.from_tokenizer(info.tokenizer, n_vocab=info.vocab_size, eos_token=stops)
            return self._tokenizer

    def _grammar(self, key: GrammarKey) -> str:
        try:
            if key.kind == "json_schema":
                # Compact separators by default, like the xgrammar backend.
                return llguidance.LLMatcher.grammar_from_json_schema(
                    key.text, defaults={"whitespace_flexible": False})
            if key.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(key.text)
            if key.kind == "ebnf":
                return llguidance.grammar_from("ebnf", key.text)
        except Exception as exc:
            raise GrammarError(f"{key.field}: {exc}", key.field) from None
        raise GrammarError(f"{key.field}: grammar kind '{key.kind}' is not supported by llguidance", key.field)

    def validate(self, key: GrammarKey) -> None:
        error = llguidance.LLMatcher.validate_grammar(self._grammar(key))
        if error:
            raise GrammarError(f"{key.field}: {_first_line(error)}", key.field)

    def compile(self, key: GrammarKey) -> Any:
        matcher = llguidance.LLMatcher(self.lltokenizer, self._grammar(key), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{key.field}: {_first_line(matcher.get_error())}", key.field)
        return matcher

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), frozenset(self.tokenizer_info.stop_token_ids))


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return lines[0] if lines else message
