"""engine.constrained without a model: the compile cache, the HTTP-side validator, the portable
mask, and --grammar-backend selection (CLI, YAML)."""

from __future__ import annotations

import pathlib
import threading
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from engine.constrained import (
    GrammarCompiler,
    GrammarError,
    GrammarKey,
    allocate_bitmask,
    allowed_tokens,
    apply_token_bitmask,
    unpack_bitmask,
)
from engine.constrained.validation import GrammarValidator


class _CountingBackend:
    """compile() counts calls; a key whose text is 'bad' fails; 'slow' waits for ``gate``."""

    def __init__(self) -> None:
        self.calls: list[GrammarKey] = []
        self.gate = threading.Event()

    def compile(self, key: GrammarKey) -> Any:
        self.calls.append(key)
        if key.text == "slow":
            assert self.gate.wait(10)
        if key.text == "bad":
            raise ValueError("library says no")
        return ("compiled", key.text)

    def matcher(self, compiled: Any) -> Any:
        return compiled


def test_compiler_caches_by_key_and_evicts_least_recent() -> None:
    backend = _CountingBackend()
    compiler = GrammarCompiler(lambda: backend, cache_size=2)
    a, b, c = (GrammarKey("regex", t) for t in "abc")
    assert compiler.submit(a).result() == ("compiled", "a")
    compiler.submit(b).result()
    compiler.submit(a).result()  # a is now the most recent
    compiler.submit(c).result()  # evicts b
    assert compiler.cached(a) and compiler.cached(c) and not compiler.cached(b)
    compiler.submit(b).result()
    assert [k.text for k in backend.calls] == ["a", "b", "c", "b"]
    assert compiler.compiles == 4 and compiler.hits == 1


def test_compiler_shares_an_inflight_compile_and_forgets_failures() -> None:
    backend = _CountingBackend()
    compiler = GrammarCompiler(lambda: backend)
    slow = GrammarKey("regex", "slow")
    first, second = compiler.submit(slow), compiler.submit(slow)
    assert first is second and not first.done()
    backend.gate.set()
    assert first.result() == ("compiled", "slow") and len(backend.calls) == 1
    bad = GrammarKey("json_schema", "bad")
    with pytest.raises(GrammarError, match="json_schema: cannot compile: library says no") as info:
        compiler.submit(bad).result()
    assert info.value.field == "json_schema"
    assert not compiler.cached(bad)
    with pytest.raises(GrammarError):
        compiler.submit(bad).result()
    assert [k.text for k in backend.calls].count("bad") == 2  # tried again, not served from the cache


def test_portable_mask_and_bitmask_helpers() -> None:
    vocab = 70
    bitmask = allocate_bitmask(2, vocab)
    assert bitmask.shape == (2, 3) and bitmask.dtype == torch.int32 and bitmask.eq(-1).all()
    bitmask[1].zero_()
    for t in (0, 31, 32, 69):
        bitmask[1, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    assert allowed_tokens(bitmask[1], vocab) == [0, 31, 32, 69]
    assert unpack_bitmask(bitmask, vocab)[0].all()
    logits = torch.zeros(2, vocab + 5)  # padded past the vocabulary, within the bitmask (96 columns)
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[1]).nonzero().view(-1).tolist() == [0, 31, 32, 69]
    wide = torch.zeros(1, 100)  # wider than the bitmask covers (96): the rest is -inf
    apply_token_bitmask(wide, allocate_bitmask(1, vocab))
    assert torch.isinf(wide[0, 96:]).all() and torch.isfinite(wide[0, :96]).all()


def test_validator_caches_verdicts_and_checks_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llguidance")
    validator = GrammarValidator("llguidance", object(), 100, [3])
    calls: list[GrammarKey] = []

    class _Backend:
        def validate(self, key: GrammarKey) -> None:
            calls.append(key)
            if key.text == "(":
                raise GrammarError("regex: unclosed group", "regex")

    monkeypatch.setattr(validator, "_get_backend", lambda: _Backend())
    for _ in range(2):
        with pytest.raises(GrammarError, match="invalid regex: unclosed group"):
            validator.check(GrammarKey("regex", "("))
        validator.check(GrammarKey("regex", "a+"))
    assert len(calls) == 2
    with pytest.raises(GrammarError, match="'llguidance' does not support structural_tag; it supports") as info:
        validator.check(GrammarKey("structural_tag", "{}"))
    assert info.value.field == "structural_tag"
    with pytest.raises(GrammarError, match="--skip-tokenizer-init"):
        GrammarValidator("llguidance", None, 100, [3]).check(GrammarKey("regex", "a"))


def test_grammar_backend_flag_and_yaml(tmp_path: pathlib.Path) -> None:
    from engine.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["config", "show", "--grammar-backend", "xgramar"])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "--grammar-backend: unknown grammar backend 'xgramar'; installed:" in lines[0]
    assert "xgrammar" in lines[0] and "did you mean xgrammar" in lines[0]
    f = tmp_path / "c.yaml"
    f.write_text("grammar_backend: llguidance\n")
    res = runner.invoke(app, ["config", "show", "--config", str(f), "--json"])
    assert res.exit_code == 0 and '"grammar_backend": "llguidance"' in res.output, res.output
