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
    GrammarBackend,
    GrammarCompiler,
    GrammarError,
    GrammarKey,
    GrammarMatcher,
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


class _ScriptMatcher(GrammarMatcher):
    """Accepts exactly ``script`` in order; counts ``accept_token`` calls."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.pos, self.calls = script, 0, 0

    def accept_token(self, token_id: int) -> bool:
        self.calls += 1
        if self.pos < len(self.script) and self.script[self.pos] == token_id:
            self.pos += 1
            return True
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        raise AssertionError("not used")

    def is_terminated(self) -> bool:
        return self.pos == len(self.script)

    def copy(self) -> _ScriptMatcher:
        raise AssertionError("not used")


class _ScriptBackend(GrammarBackend):
    """Only the interface's default ``accept_tokens`` (a backend that does not override it)."""

    def compile(self, key: GrammarKey) -> Any:
        raise AssertionError("not used")

    def matcher(self, compiled: Any) -> GrammarMatcher:
        raise AssertionError("not used")


def test_default_accept_tokens_asks_each_matcher_in_turn() -> None:
    backend = _ScriptBackend(None)  # type: ignore[arg-type]
    matchers = [_ScriptMatcher([5, 6]), _ScriptMatcher([7]), _ScriptMatcher([8, 9])]
    assert backend.accept_tokens(matchers, [5, 1, 8]) == [True, False, True]
    assert backend.accept_tokens(matchers, [6, 7, 8]) == [True, True, False]
    assert [m.pos for m in matchers] == [2, 1, 1] and [m.calls for m in matchers] == [2, 2, 2]
    assert backend.accept_tokens([], []) == []
    with pytest.raises(ValueError, match="3 matchers but 2 token ids"):
        backend.accept_tokens(matchers, [1, 2])


def test_grammar_queue_accepts_a_step_in_one_call_and_requests_take_the_verdicts() -> None:
    """Only constrained, unfinished rows whose token is appended reach the backend, in one call;
    ``append_output`` then aborts a refused row and leaves an accepted one, without asking again."""
    from engine.constrained.scheduling import GrammarQueue
    from engine.managers.schedule_batch import FinishReason, Req
    from engine.sampling.sampling_params import SamplingParams

    calls: list[list[int]] = []

    class Recording(_ScriptBackend):
        def accept_tokens(self, matchers: Any, token_ids: Any) -> list[bool]:
            calls.append(list(token_ids))
            return super().accept_tokens(matchers, token_ids)

    queue = GrammarQueue("none", None, 16, set(), torch.device("cpu"))
    queue.compiler = GrammarCompiler(lambda: Recording(None))  # type: ignore[arg-type]
    reqs = [Req(f"r{i}", [1, 2], SamplingParams(max_new_tokens=4), {3}) for i in range(5)]
    for req, script in zip(reqs, ([10], [11], None, [13], [14])):
        req.grammar = None if script is None else _ScriptMatcher(script)
    reqs[3].finished_reason = FinishReason("abort", message="client gone")
    tokens = [10, 99, 12, 13, 14]
    verdicts = queue.accept_tokens(reqs, tokens, appends=[True, True, True, True, False])
    assert calls == [[10, 99]] and verdicts == [True, False, None, None, None]
    for req, token, verdict in zip(reqs[:4], tokens, verdicts):
        req.append_output(token, verdict)
    assert [r.grammar.calls for r in (reqs[0], reqs[1], reqs[3])] == [1, 1, 0]
    assert not reqs[0].finished() and reqs[0].output_ids == [10]
    assert reqs[1].finished_reason.kind == "abort" and "refused token 99" in reqs[1].finished_reason.message
    assert reqs[1].output_ids == [99] and not reqs[2].finished() and reqs[3].output_ids == [13]
    # One token at a time (the speculative path): no verdict, the matcher takes it in append_output.
    reqs[4].append_output(14)
    assert reqs[4].grammar.calls == 1 and reqs[4].grammar.is_terminated() and not reqs[4].finished()
    assert queue.accept_tokens(reqs[2:3], [1]) == [None] and len(calls) == 1  # nothing constrained: no call


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
