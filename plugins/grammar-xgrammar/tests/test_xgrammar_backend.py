"""The xgrammar backend: the grammar kit, plus what only xgrammar does (structural tags)."""

from __future__ import annotations

import json
from typing import Any

from engine.constrained import GrammarKey
from engine.testing.grammar_kit import GrammarBackendConformance


class TestXGrammar(GrammarBackendConformance):
    backend_name = "xgrammar"
    # xgrammar's compact JSON (any_whitespace off) keeps one space after "," and ":".
    json_separators = (", ", ": ")

    def test_structural_tag_constrains_only_inside_the_tags(self, backend: Any, tokenizer: Any) -> None:
        tag = {"structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                          "required": ["x"]}, "end": "</f>"}],
               "triggers": ["<f>"]}
        compiled = backend.compile(GrammarKey("structural_tag", json.dumps(tag)))
        assert self._accepts(backend, compiled, tokenizer, 'free text <f>{"x": 3}</f> more')
        assert not self._accepts(backend, compiled, tokenizer, 'free text <f>{"x": "a"}</f>')

    def test_any_whitespace_option_allows_spaced_json(self, tokenizer: Any) -> None:
        from engine.constrained import TokenizerInfo
        from engine_grammar_xgrammar.backend import XGrammarBackend

        info = TokenizerInfo(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
        key = GrammarKey("json_schema", json.dumps({"type": "object"}))
        loose = XGrammarBackend(info, options={"any_whitespace": True})
        strict = XGrammarBackend(info)
        text = '{ "a" :  1 }'
        assert self._accepts(loose, loose.compile(key), tokenizer, text)
        assert not self._accepts(strict, strict.compile(key), tokenizer, text)
