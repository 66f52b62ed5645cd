"""Structured output in the scheduler: compile off the loop, masks per step, every schedule mode.

A random tiny model writes whatever its weights favour; under a grammar its output must still be
in the grammar's language, whatever the batching (chunked prefill, radix cache, mixed chunks,
retraction, overlap), and nothing else in the batch may change.
"""

from __future__ import annotations

import json
import random
import re
import threading
from typing import Any

import pytest

from engine.constrained import GrammarCompiler, GrammarKey
from engine.managers.scheduler import check_no_leak
from engine.testing.harness import OutputCollector, generate_greedy, make_scheduler, submit

pytest.importorskip("xgrammar")

EOS = 3
# A finite language: the tiny model must end it within a few tokens.
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "ok", "n"]}
REGEX = r"[0-9]{3}-[a-z]{2}"


@pytest.fixture(scope="module")
def tokenizer(llama_ckpt: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_ckpt)


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _run(sched: Any, jobs: list[tuple[list[int], dict[str, Any]]]) -> tuple[list[str], OutputCollector]:
    col = OutputCollector()
    rids = [submit(sched, p, sp) for p, sp in jobs]
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    return rids, col


def _text(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode([t for t in ids if t != EOS])


def _check_json(tokenizer: Any, ids: list[int], finish: dict[str, Any]) -> None:
    import jsonschema

    assert finish["type"] == "stop" and finish["matched"] == EOS, finish
    jsonschema.validate(json.loads(_text(tokenizer, ids)), SCHEMA)


@pytest.mark.parametrize("kwargs", [
    {},
    {"chunked_prefill_size": 8},
    {"disable_radix_cache": True, "chunked_prefill_size": 16},
    {"page_size": 4},
    {"enable_mixed_chunk": True, "chunked_prefill_size": 8},
    {"grammar_backend": "llguidance"},
], ids=["default", "chunked", "chunk-cache", "paged", "mixed", "llguidance"])
def test_constrained_output_is_in_the_language_and_others_unchanged(
        llama_ckpt: str, tokenizer: Any, kwargs: dict[str, Any]) -> None:
    if kwargs.get("grammar_backend") == "llguidance":
        pytest.importorskip("llguidance")
    prompts = _prompts(1, 6)
    free = {"max_new_tokens": 10, "temperature": 0}
    alone = generate_greedy(make_scheduler(llama_ckpt), prompts[4:], 10)
    jobs = [(prompts[0], {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(SCHEMA)}),
            (prompts[1], {"max_new_tokens": 40, "temperature": 1.0, "seed": 7, "json_schema": json.dumps(SCHEMA)}),
            (prompts[2], {"max_new_tokens": 12, "temperature": 0, "regex": REGEX}),
            (prompts[3], {"max_new_tokens": 12, "temperature": 0.8, "ebnf": 'root ::= ("yes" | "no") "!"'}),
            (prompts[4], free), (prompts[5], free)]
    sched = make_scheduler(llama_ckpt, **kwargs)
    rids, col = _run(sched, jobs)
    for rid in rids[:2]:
        _check_json(tokenizer, col.ids[rid], col.finish[rid])
    assert re.fullmatch(REGEX, _text(tokenizer, col.ids[rids[2]])), col.ids[rids[2]]
    assert _text(tokenizer, col.ids[rids[3]]) in ("yes!", "no!")
    assert [col.ids[r] for r in rids[4:]] == alone, "a mask leaked into unconstrained rows"
    check_no_leak(sched)


def test_overlap_schedule_fills_masks_after_the_previous_token(llama_ckpt: str, tokenizer: Any) -> None:
    prompts = _prompts(2, 4)
    jobs = [(p, {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(SCHEMA)}) for p in prompts[:3]]
    jobs.append((prompts[3], {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}))
    plain = make_scheduler(llama_ckpt)
    want_rids, want = _run(plain, jobs)
    sched = make_scheduler(llama_ckpt)
    sched.enable_overlap = True
    rids, col = _run(sched, jobs)
    assert sched.overlapped_decode_steps > 0
    assert [col.ids[r] for r in rids] == [want.ids[r] for r in want_rids]
    for rid in rids[:3]:
        _check_json(tokenizer, col.ids[rid], col.finish[rid])
    check_no_leak(sched)


def test_retraction_keeps_matcher_and_output_consistent(llama_ckpt: str, tokenizer: Any) -> None:
    """A KV pool too small for every request: some are retracted and resume; their matcher has
    accepted exactly their output, so they generate what they would have without retraction."""
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 2048) for _ in range(rng.randint(20, 40))] for _ in range(8)]
    regex = r"[a-z]{30,40}"
    jobs = [(p, {"max_new_tokens": 41, "temperature": 0, "regex": regex}) for p in prompts]
    want_rids, want = _run(make_scheduler(llama_ckpt), jobs)
    sched = make_scheduler(llama_ckpt, max_total_tokens=320, schedule_conservativeness=0.05)
    rids, col = _run(sched, jobs)
    assert sched.num_retractions > 0
    assert [col.ids[r] for r in rids] == [want.ids[r] for r in want_rids]
    for rid in rids:
        assert re.fullmatch(regex, _text(tokenizer, col.ids[rid])), col.ids[rid]
    check_no_leak(sched)


def test_grammar_that_cannot_finish_ends_with_length(llama_ckpt: str) -> None:
    sched = make_scheduler(llama_ckpt)
    rids, col = _run(sched, [(_prompts(4, 1)[0], {"max_new_tokens": 5, "temperature": 0, "regex": "[a-z]{50}"})])
    assert col.finish[rids[0]] == {"type": "length", "length": 5}
    assert len(col.ids[rids[0]]) == 5


def test_compile_failure_ends_only_that_request(llama_ckpt: str) -> None:
    """Validation upstream normally stops a bad grammar; the scheduler must survive one anyway."""
    sched = make_scheduler(llama_ckpt)
    prompts = _prompts(5, 2)
    rids, col = _run(sched, [(prompts[0], {"max_new_tokens": 4, "regex": "a(b"}),
                             (prompts[1], {"max_new_tokens": 4, "temperature": 0})])
    assert col.finish[rids[0]]["type"] == "abort" and "regex" in col.finish[rids[0]]["message"]
    assert col.finish[rids[1]]["type"] == "length"
    check_no_leak(sched)


class _SlowBackend:
    """Wraps a backend so that compiles wait for an event (a schema that takes long)."""

    def __init__(self, inner: Any, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def compile(self, key: GrammarKey) -> Any:
        assert self.gate.wait(30)
        return self.inner.compile(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_request_waits_in_the_queue_while_its_grammar_compiles(llama_ckpt: str) -> None:
    sched = make_scheduler(llama_ckpt)
    gate = threading.Event()
    real = sched.grammar_queue.compiler.backend
    sched.grammar_queue.compiler = GrammarCompiler(lambda: _SlowBackend(real, gate))
    prompts = _prompts(6, 2)
    col = OutputCollector()
    slow = submit(sched, prompts[0], {"max_new_tokens": 12, "temperature": 0, "regex": REGEX})
    free = submit(sched, prompts[1], {"max_new_tokens": 6, "temperature": 0})
    for _ in range(8):  # the free request runs to its end; the constrained one never enters a batch
        sched.step()
        col.collect(sched)
        assert all(r.rid != slow for r in sched.running_batch.reqs + sched.waiting_queue)
    assert col.finish[free]["type"] == "length" and slow not in col.ids
    assert [r.rid for r in sched.grammar_queue.waiting] == [slow]
    gate.set()
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    assert col.finish[slow]["type"] == "stop"
    check_no_leak(sched)


def test_compiled_grammars_are_cached_by_key(llama_ckpt: str) -> None:
    sched = make_scheduler(llama_ckpt)
    prompts = _prompts(7, 3)
    _run(sched, [(prompts[0], {"max_new_tokens": 12, "regex": REGEX})])
    _run(sched, [(p, {"max_new_tokens": 12, "regex": REGEX}) for p in prompts[1:]])
    assert sched.grammar_queue.compiler.compiles == 1
    assert sched.grammar_queue.compiler.cached(GrammarKey("regex", REGEX))
    stats = sched.stats()
    assert stats["grammar_compiles"] == 1 and stats["grammar_cache_hits"] == 2 and stats["num_grammar_queue_reqs"] == 0


def test_abort_while_compiling(llama_ckpt: str) -> None:
    sched = make_scheduler(llama_ckpt)
    gate = threading.Event()
    real = sched.grammar_queue.compiler.backend
    sched.grammar_queue.compiler = GrammarCompiler(lambda: _SlowBackend(real, gate))
    rid = submit(sched, _prompts(8, 1)[0], {"max_new_tokens": 12, "regex": REGEX})
    sched.abort_request(rid, "client disconnected")
    col = OutputCollector()
    sched.step()
    col.collect(sched)
    gate.set()
    assert col.finish[rid]["type"] == "abort" and not sched.grammar_queue.waiting
    assert not sched.step() or not sched.has_work()


def test_logit_bias_steers_greedy_choice(llama_ckpt: str) -> None:
    prompt = _prompts(9, 1)[0]
    sched = make_scheduler(llama_ckpt)
    biased = generate_greedy(sched, [prompt], 4, logit_bias={"1234": 100.0})[0]
    assert biased == [1234] * 4
    banned = generate_greedy(sched, [prompt], 4)[0]
    again = generate_greedy(sched, [prompt], 4, logit_bias={str(banned[0]): -100.0})[0]
    assert again[0] != banned[0]


class _LeakyBackend:
    """Wraps a backend: a row's mask allows every token once its matcher has accepted two (so
    the model samples tokens the grammar refuses, in decode steps); records the size of each
    ``accept_tokens`` call; ``per_row``: the interface's default loop instead of the backend's."""

    def __init__(self, inner: Any, per_row: bool) -> None:
        self.inner, self.per_row = inner, per_row
        self.calls: list[int] = []
        self.accepted: dict[int, int] = {}

    def fill_bitmasks(self, matchers: list[Any], bitmask: Any, rows: list[int]) -> None:
        keep = [(m, r) for m, r in zip(matchers, rows) if self.accepted.get(id(m), 0) < 2]
        self.inner.fill_bitmasks([m for m, _ in keep], bitmask, [r for _, r in keep])
        for m, r in zip(matchers, rows):  # a backend writes every row it is given (the contract)
            if self.accepted.get(id(m), 0) >= 2:
                bitmask[r] = -1

    def accept_tokens(self, matchers: list[Any], token_ids: list[int]) -> list[bool]:
        from engine.constrained import GrammarBackend

        self.calls.append(len(matchers))
        if self.per_row:
            verdicts = GrammarBackend.accept_tokens(self.inner, matchers, token_ids)
        else:
            verdicts = self.inner.accept_tokens(matchers, token_ids)
        for matcher, ok in zip(matchers, verdicts):
            self.accepted[id(matcher)] = self.accepted.get(id(matcher), 0) + int(ok)
        return verdicts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_step_accepts_in_one_batch_call_with_per_row_results(llama_ckpt: str) -> None:
    """Every step feeds all its constrained rows to the backend in one call (prefill's first
    tokens too), and the outcome equals per-row acceptance: refused tokens (the mask leaks after
    two tokens) abort exactly those requests, others finish as before, with and without overlap."""
    prompts = _prompts(11, 18)
    regex = r"[a-z]{2,30}"
    jobs = [(p, {"max_new_tokens": 12, "temperature": 0, "regex": regex}) for p in prompts[:16]]
    jobs += [(p, {"max_new_tokens": 12, "temperature": 0}) for p in prompts[16:]]
    results = []
    for per_row, overlap in ((True, False), (False, False), (False, True)):
        sched = make_scheduler(llama_ckpt)
        sched.enable_overlap = overlap
        leaky = _LeakyBackend(sched.grammar_queue.compiler.backend, per_row)
        sched.grammar_queue.compiler = GrammarCompiler(lambda leaky=leaky: leaky)
        rids, col = _run(sched, jobs)
        results.append(([col.ids[r] for r in rids], [col.finish[r] for r in rids]))
        assert max(leaky.calls) == 16, leaky.calls  # all constrained rows of a step in one call
        assert len(leaky.calls) <= sched.forward_steps
        if overlap:
            assert sched.overlapped_decode_steps > 0
        check_no_leak(sched)
    assert results[1] == results[0] and results[2] == results[0]
    ids, finishes = results[0]
    aborted = [f for f in finishes[:16] if f["type"] == "abort"]
    assert aborted and all("refused" in f["message"] for f in aborted), finishes
    assert all(len(i) >= 3 for i, f in zip(ids, finishes) if f["type"] == "abort"), "refused before the leak"
    assert finishes[16:] == [{"type": "length", "length": 12}] * 2
