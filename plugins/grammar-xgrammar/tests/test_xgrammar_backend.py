"""The xgrammar backend: the grammar kit, plus what only xgrammar does (structural tags)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from engine.constrained import GrammarKey, TokenizerInfo, allocate_bitmask, apply_token_bitmask
from engine.testing.grammar_kit import GrammarBackendConformance


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Any:
    """The kit's byte-level tokenizer (2,048 tokens), outside the kit's class."""
    import os

    from transformers import AutoTokenizer

    import engine.testing

    return AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(engine.testing.__file__), "tiny_tokenizer"))


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


@pytest.mark.parametrize("accept_threads", [1, 4])
def test_batch_accept_runs_in_xgrammar_and_equals_row_by_row(tiny_tokenizer: Any, accept_threads: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A recorded JSON walk of 32 rows (a refused token among them) fed through ``accept_tokens``,
    in one batch call or in thread slices, gives per-row ``accept_token``'s verdicts and states,
    without a Python call per row."""
    import engine_grammar_xgrammar.backend as xgb
    from engine_grammar_xgrammar.backend import XGrammarBackend, XGrammarMatcher

    monkeypatch.setattr(xgb, "_ACCEPT_ROWS_PER_THREAD", 8)  # 32 rows: 4 slices, as 1024 rows would be
    tokenizer = tiny_tokenizer
    info = TokenizerInfo(tokenizer, len(tokenizer) + 64, (tokenizer.eos_token_id,))
    backend = XGrammarBackend(info, options={"accept_threads": accept_threads})
    schema = {"type": "object", "properties": {"k": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["k", "n"]}
    compiled = backend.compile(GrammarKey("json_schema", json.dumps(schema)))
    rows = 32
    # Record each row's walk: tokens drawn from what the grammar allows, from a seeded generator.
    gen = torch.Generator().manual_seed(5)
    recorder = [backend.matcher(compiled) for _ in range(rows)]
    recorded: list[list[int]] = []
    bitmask = allocate_bitmask(rows, info.vocab_size)
    for _ in range(12):
        bitmask.fill_(-1)
        backend.fill_bitmasks(recorder, bitmask, list(range(rows)))
        logits = torch.randn(rows, info.vocab_size, generator=gen)
        apply_token_bitmask(logits, bitmask)
        step = logits.argmax(-1).tolist()
        assert all(m.accept_token(t) for m, t in zip(recorder, step))
        recorded.append(step)
    # Row 7 starts with a token JSON refuses (then goes on refusing its walk from the start state).
    recorded[0][7] = tokenizer.encode("x", add_special_tokens=False)[0]
    batch = [backend.matcher(compiled) for _ in range(rows)]
    twins = [backend.matcher(compiled) for _ in range(rows)]
    with monkeypatch.context() as patch:
        patch.setattr(XGrammarMatcher, "accept_token", lambda self, token_id: pytest.fail("a per-row accept"))
        got = [backend.accept_tokens(batch, step) for step in recorded]
    want = [[m.accept_token(t) for m, t in zip(twins, step)] for step in recorded]
    assert got == want and not want[0][7]
    assert all(all(step[:7] + step[8:]) for step in want), "the other rows' walks are accepted"
    masks, twin_masks = allocate_bitmask(rows, info.vocab_size), allocate_bitmask(rows, info.vocab_size)
    backend.fill_bitmasks(batch, masks, list(range(rows)))
    backend.fill_bitmasks(twins, twin_masks, list(range(rows)))
    assert torch.equal(masks, twin_masks)
    with pytest.raises(ValueError, match="2 matchers but 1 token ids"):
        backend.accept_tokens(batch[:2], [0])


def test_padded_vocabulary_is_masked_by_the_backend_not_xgrammar(tiny_tokenizer: Any) -> None:
    """Logits much wider than the tokenizer (a Llama-3-shaped head over a small tokenizer): xgrammar
    is told the tokenizer's ids only, the backend clears the padded words, and the masks and
    verdicts equal those of an unpadded backend, row by row and in a batch (rows left out untouched)."""
    from engine_grammar_xgrammar.backend import XGrammarBackend

    tok = tiny_tokenizer
    size = len(tok)
    padded, plain = (XGrammarBackend(TokenizerInfo(tok, v, (tok.eos_token_id,), "tiny"), {"fill_threads": 2})
                     for v in (size + 3000, size))
    key = GrammarKey("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "string"}},
                                                "required": ["a"]}))
    cp, cu = padded.compile(key), plain.compile(key)
    assert padded.compiler is not None and padded._vocab == size  # a whole number of words here
    words = (size + 31) // 32
    text = tok.encode('{"a": "xyz', add_special_tokens=False)
    mp = [padded.matcher(cp) for _ in range(5)]
    mu = [plain.matcher(cu) for _ in range(5)]
    for i in range(5):  # row i has read i + 1 tokens of the text
        for t in text[: i + 1]:
            assert mp[i].accept_token(t) and mu[i].accept_token(t)
    got = torch.randint(-(2**31), 2**31 - 1, (6, (size + 3000 + 31) // 32), dtype=torch.int32)
    untouched = got[5].clone()
    padded.fill_bitmasks(mp, got, [0, 1, 2, 3, 4])
    want = allocate_bitmask(5, size)
    plain.fill_bitmasks(mu, want, [0, 1, 2, 3, 4])
    assert torch.equal(got[:5, :words], want) and not got[:5, words:].any()
    assert torch.equal(got[5], untouched)
    one = torch.full((1, got.shape[1]), -1, dtype=torch.int32)
    mp[2].fill_bitmask(one, 0)
    assert torch.equal(one[0, :words], want[2]) and not one[0, words:].any()
    logits = torch.zeros(1, size + 3000)
    apply_token_bitmask(logits, one)
    assert torch.isinf(logits[0, size:]).all()
    # Padding ids are refused (state unchanged), alone and inside a batch.
    assert not mp[0].accept_token(size + 5)
    assert padded.accept_tokens(mp[:2], [size + 5, text[2]]) == [False, True]
