"""The kits themselves: fixtures above function scope are classmethods (pytest deprecates
instance-method ones), the grammar kit catches a backend that lets a request end inside an
unfinished JSON document and says so in words, and the speculative kit never reuses a request id."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import pytest

from engine.constrained import GrammarBackend, GrammarKey, GrammarMatcher
from engine.testing import conformance
from engine.testing.conformance.speculative import SpeculativeProposerConformance
from engine.testing.grammar_kit import GrammarBackendConformance


def _kit_classes() -> list[type]:
    kits = {GrammarBackendConformance, SpeculativeProposerConformance}
    for name in dir(conformance):
        obj = getattr(conformance, name)
        if inspect.isclass(obj) and name.endswith("Conformance"):
            kits.add(obj)
    return sorted(kits, key=lambda c: c.__name__)


@pytest.mark.parametrize("kit", _kit_classes(), ids=lambda c: c.__name__)
def test_wide_scoped_kit_fixtures_are_classmethods(kit: type) -> None:
    for klass in kit.__mro__:
        for name, value in vars(klass).items():
            marker = getattr(value, "_fixture_function_marker", None)
            if marker is None or marker.scope in ("function", None):
                continue
            wrapped = value._fixture_function
            assert isinstance(wrapped, (classmethod, staticmethod)), (
                f"{klass.__name__}.{name} is a {marker.scope}-scoped fixture defined as an instance method "
                "(deprecated by pytest): decorate it with @classmethod")


class _EndsAnywhere(GrammarMatcher):
    """Delegates to a real matcher but allows and accepts the stop token everywhere."""

    def __init__(self, inner: GrammarMatcher, eos: int) -> None:
        self.inner, self.eos, self.ended = inner, eos, False

    def accept_token(self, token_id: int) -> bool:
        if token_id == self.eos:
            self.ended = True
            return True
        return self.inner.accept_token(token_id)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)
        word, bit = divmod(self.eos, 32)
        bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)

    def is_terminated(self) -> bool:
        return self.ended or self.inner.is_terminated()

    def copy(self) -> GrammarMatcher:
        return _EndsAnywhere(self.inner.copy(), self.eos)


class _LeakyBackend(GrammarBackend):
    def __init__(self, inner: GrammarBackend, eos: int) -> None:
        super().__init__(inner.tokenizer_info)
        self.inner, self.eos = inner, eos

    def compile(self, key: GrammarKey) -> Any:
        return self.inner.compile(key)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return _EndsAnywhere(self.inner.matcher(compiled), self.eos)


class _XGrammarKit(GrammarBackendConformance):
    backend_name = "xgrammar"
    json_separators = (", ", ": ")  # as the xgrammar plugin's own test declares


def test_grammar_kit_refuses_a_backend_that_ends_inside_json() -> None:
    import os

    from transformers import AutoTokenizer

    import engine.testing
    from engine import plugins
    from engine.constrained import TokenizerInfo

    pytest.importorskip("xgrammar")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(engine.testing.__file__), "tiny_tokenizer"))
    info = TokenizerInfo(tokenizer, len(tokenizer) + 64, (tokenizer.eos_token_id,), "tiny")
    backend = plugins.create_grammar_backend("xgrammar", info)
    kit = _XGrammarKit()
    text = '{"name": "Ann"'
    # The real backend passes ...
    kit.test_end_of_text_is_refused_inside_an_unfinished_json_document(text, backend, tokenizer)
    # ... one that lets the request end there fails, with a sentence, not a bare assert.
    leaky = _LeakyBackend(backend, tokenizer.eos_token_id)
    with pytest.raises(AssertionError, match="the mask allows the stop token after the unfinished JSON document"):
        kit.test_end_of_text_is_refused_inside_an_unfinished_json_document(text, leaky, tokenizer)


class _RecordingProposerKit(SpeculativeProposerConformance):
    algorithm_name = "ngram"


def test_speculative_kit_uses_fresh_request_ids(monkeypatch: pytest.MonkeyPatch, llama_ckpt: str) -> None:
    """A request id the kit shows a proposer again carries the same prompt and an output that
    continues the one shown before, as in the engine."""
    from engine.speculative import DraftRequest

    seen: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    reused: list[str] = []
    kit = _RecordingProposerKit()
    real = kit._proposer

    def proposer(path: str) -> Any:
        inner = real(path)
        original = inner.propose

        def propose(reqs: Sequence[DraftRequest]) -> Any:
            for r in reqs:
                state = (tuple(r.prompt_ids), tuple(r.output_ids))
                # A running request keeps its prompt; its output only grows at the end.
                if r.rid in seen:
                    prompt, output = seen[r.rid]
                    if prompt != state[0] or state[1][: len(output)] != output:
                        reused.append(r.rid)
                seen[r.rid] = state
            return original(reqs)

        inner.propose = propose
        return inner

    monkeypatch.setattr(kit, "_proposer", proposer)
    kit.test_drafts_are_well_formed(llama_ckpt)
    assert seen and not reused, f"request ids reused with another prompt or a shorter output: {reused}"
