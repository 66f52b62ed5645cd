"""The llguidance backend through the grammar kit: a second library behind the same interface."""

from __future__ import annotations

from typing import Any

from engine.constrained import GrammarKey
from engine.testing.grammar_kit import GrammarBackendConformance


class TestLLGuidance(GrammarBackendConformance):
    backend_name = "llguidance"
    # whitespace_flexible off: no spaces at all.
    json_separators = (",", ":")

    def test_lark_grammar_is_accepted_as_ebnf(self, backend: Any, tokenizer: Any) -> None:
        compiled = backend.compile(GrammarKey("ebnf", 'start: "a"+ "b"'))
        assert self._accepts(backend, compiled, tokenizer, "aab")
        assert not self._accepts(backend, compiled, tokenizer, "b")
