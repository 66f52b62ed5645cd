"""What a proposer hears of a request's life: ``on_request_end`` with the prompt and final
output once per request, and ``release(rid, reason)`` on every end (finished in a verify step,
in a plain decode step, in the prefill, aborted) and on every retraction; a proposer written with
the older ``release(rid)`` is still called."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from engine.managers.scheduler import check_no_leak
from engine.speculative import DraftRequest, Proposer, RequestEnd
from engine.testing.harness import OutputCollector, make_scheduler, submit


class RecordingProposer(Proposer):
    """Drafts nothing useful (random ids) and records every call about a request's end."""

    def __init__(self) -> None:
        self.rng = random.Random(3)
        self.released: list[tuple[str, str]] = []
        self.ended: list[RequestEnd] = []

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        return [[self.rng.randrange(2048) for _ in range(r.max_draft)] for r in reqs]

    def release(self, rid: str, reason: str = "finished") -> None:
        self.released.append((rid, reason))

    def on_request_end(self, end: RequestEnd) -> None:
        self.ended.append(end)


class OldStyleProposer(Proposer):
    """A proposer as hook API 5 documented it: ``release(rid)`` only, no ``on_request_end``."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        return [[] for _ in reqs]

    def release(self, rid: str) -> None:  # type: ignore[override]
        self.released.append(rid)


def _prompts(n: int, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2048) for _ in range(rng.randint(4, 20))] for _ in range(n)]


def _run(sched: Any, col: OutputCollector) -> None:
    while sched.step():
        col.collect(sched)
    col.collect(sched)


def _spec(path: str, proposer: Proposer, **kw: Any) -> Any:
    sched = make_scheduler(path, speculative_algorithm="ngram", speculative_num_steps=3, **kw)
    sched.speculator.proposer = proposer
    return sched


def test_every_finish_releases_once_with_the_final_output(llama_ckpt: str) -> None:
    """Three requests finishing at different steps (one in its prefill) each give one
    ``on_request_end`` carrying prompt and output, then one ``release(rid, "finished")``."""
    proposer = RecordingProposer()
    sched = _spec(llama_ckpt, proposer)
    prompts = _prompts(3)
    lengths = [1, 5, 9]  # max_new_tokens=1 ends in the prefill, never proposed for
    rids = [submit(sched, p, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
            for p, n in zip(prompts, lengths)]
    col = OutputCollector()
    _run(sched, col)
    assert sorted(proposer.released) == sorted((r, "finished") for r in rids)
    ends = {e.rid: e for e in proposer.ended}
    assert sorted(ends) == sorted(rids)
    for rid, prompt, n in zip(rids, prompts, lengths):
        assert list(ends[rid].prompt_ids) == prompt
        assert list(ends[rid].output_ids) == col.ids[rid] and len(col.ids[rid]) == n
        assert ends[rid].reason == "finished" and ends[rid].finish_reason == {"type": "length", "length": n}
    assert sched.speculator.stats.verify_steps > 0
    check_no_leak(sched)


def test_batches_above_the_speculation_limit_still_release(llama_ckpt: str) -> None:
    """Twelve requests above --speculative-max-batch-size decode plainly; each still ends once."""
    proposer = RecordingProposer()
    sched = _spec(llama_ckpt, proposer, speculative_max_batch_size=2)
    rids = [submit(sched, p, {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}) for p in _prompts(12)]
    _run(sched, OutputCollector())
    assert sorted(proposer.released) == sorted((r, "finished") for r in rids)
    assert sorted(e.rid for e in proposer.ended) == sorted(rids)
    check_no_leak(sched)


def test_abort_releases_with_reason_aborted(llama_ckpt: str) -> None:
    proposer = RecordingProposer()
    sched = _spec(llama_ckpt, proposer)
    a, b = (submit(sched, p, {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}) for p in _prompts(2))
    col = OutputCollector()
    for _ in range(3):
        sched.step()
        col.collect(sched)
    sched.abort_request(a)
    _run(sched, col)
    assert col.finish[a]["type"] == "abort"
    assert sorted(proposer.released) == sorted([(a, "aborted"), (b, "finished")])
    end_a = next(e for e in proposer.ended if e.rid == a)
    assert end_a.reason == "aborted" and list(end_a.output_ids) == col.ids[a]
    check_no_leak(sched)


def test_retraction_releases_and_the_request_still_ends_once(llama_ckpt: str) -> None:
    """A pool too small for every request retracts some; each retraction is a
    ``release(rid, "retracted")``, and every request still ends exactly once."""
    proposer = RecordingProposer()
    # Requests that may stop early reserve only part of max_new_tokens: admission overcommits.
    sched = _spec(llama_ckpt, proposer, max_total_tokens=128)
    rids = [submit(sched, p, {"max_new_tokens": 32, "temperature": 0.0}) for p in _prompts(5, seed=5)]
    col = OutputCollector()
    _run(sched, col)
    assert sched.num_retractions > 0
    retracted = [r for r, why in proposer.released if why == "retracted"]
    assert len(retracted) == sched.num_retractions
    assert sorted(r for r, why in proposer.released if why == "finished") == sorted(rids)
    assert sorted(e.rid for e in proposer.ended) == sorted(rids)
    assert all(list(e.output_ids) == col.ids[e.rid] for e in proposer.ended)
    check_no_leak(sched)


def test_a_proposer_without_the_reason_argument_is_still_released(llama_ckpt: str) -> None:
    proposer = OldStyleProposer()
    sched = _spec(llama_ckpt, proposer)
    rids = [submit(sched, p, {"max_new_tokens": 4, "temperature": 0.0}) for p in _prompts(3)]
    _run(sched, OutputCollector())
    assert sorted(proposer.released) == sorted(rids)

