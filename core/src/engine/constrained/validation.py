"""Checking a request's grammar before it is queued (the HTTP / tokenizer-manager process).

A bad schema, regex or EBNF must be a 400 naming the field, never a request the scheduler
has to fail later: ``GrammarValidator.check`` runs the backend's cheap ``validate`` (no
token tables) and remembers recent verdicts by key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from engine.constrained.base import GrammarBackend, GrammarError, GrammarKey, TokenizerInfo

_VERDICTS = 512


class GrammarValidator:
    """Args:
        backend_name: ``--grammar-backend``.
        tokenizer: the HF tokenizer (None under --skip-tokenizer-init: constrained requests are refused).
        vocab_size / stop_token_ids: the model's, as the scheduler's backend sees them.
    """

    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | tuple[int, ...],
                 disabled: list[str] | tuple[str, ...] = (), plugin_options: dict[str, dict[str, Any]] | None = None) -> None:
        self.backend_name = backend_name
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop = tuple(stop_token_ids)
        self._disabled = list(disabled)
        self._plugin_options = plugin_options or {}
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[GrammarKey, str | None] = OrderedDict()

    def _get_backend(self) -> GrammarBackend:
        import engine.plugins as plugins

        with self._lock:
            if self._backend is None:
                info = TokenizerInfo(self._tokenizer, self._vocab_size, self._stop)
                self._backend = plugins.create_grammar_backend(self.backend_name, info, self._disabled,
                                                               self._plugin_options)
            return self._backend

    def check(self, key: GrammarKey) -> None:
        """Raises ``GrammarError`` (with ``field``) when ``key`` cannot be served."""
        import engine.plugins as plugins

        if self._tokenizer is None:
            raise GrammarError(f"{key.field}: structured output needs a tokenizer; this server runs with "
                               "--skip-tokenizer-init", key.field)
        kinds = plugins.get_grammar_backend(self.backend_name, self._disabled).grammar_kinds
        if key.kind not in kinds:
            raise GrammarError(f"{key.field}: the grammar backend '{self.backend_name}' does not support "
                               f"{key.kind}; it supports: {', '.join(kinds)}", key.field)
        with self._lock:
            known = key in self._verdicts
            verdict = self._verdicts.get(key)
            if known:
                self._verdicts.move_to_end(key)
        if not known:
            try:
                self._get_backend().validate(key)
                verdict = None
            except GrammarError as exc:
                verdict = str(exc)
            except Exception as exc:  # a library error on a strange grammar: still the user's field
                verdict = f"{key.field}: {exc}"
            with self._lock:
                self._verdicts[key] = verdict
                while len(self._verdicts) > _VERDICTS:
                    self._verdicts.popitem(last=False)
        if verdict is not None:
            raise GrammarError(f"invalid {verdict}" if not verdict.startswith("invalid") else verdict, key.field)
