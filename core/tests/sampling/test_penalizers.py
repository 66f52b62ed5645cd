"""Batched penalizers against a plain per-request Python reference."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from engine.sampling.penalizers import (
    BatchedPenalizerOrchestrator,
    FrequencyPenalizer,
    MinNewTokensPenalizer,
    PresencePenalizer,
    RepetitionPenalizer,
)

VOCAB = 50
EOS = {2, 3}


@dataclass
class Params:
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop_token_ids: set[int] | None = None
    ignore_eos: bool = False


@dataclass
class Req:
    sampling_params: Params
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)


def reference(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """The penalties applied one request and one token at a time, in the documented order."""
    out = logits.clone()
    for row, req in enumerate(reqs):
        p = req.sampling_params
        for t in set(req.origin_input_ids) | set(req.output_ids):
            v = out[row, t].item()
            out[row, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(req.output_ids):
            out[row, t] -= p.frequency_penalty * req.output_ids.count(t)
            out[row, t] -= p.presence_penalty
        if len(req.output_ids) < p.min_new_tokens:
            stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else EOS)
            for t in stops:
                out[row, t] = float("-inf")
    return out


def random_params(rng: random.Random, kinds: tuple[str, ...]) -> Params:
    p = Params()
    if "frequency" in kinds and rng.random() < 0.7:
        p.frequency_penalty = rng.uniform(-1.0, 2.0)
    if "presence" in kinds and rng.random() < 0.7:
        p.presence_penalty = rng.uniform(-1.0, 2.0)
    if "repetition" in kinds and rng.random() < 0.7:
        p.repetition_penalty = rng.uniform(0.5, 2.0)
    if "min_new" in kinds and rng.random() < 0.7:
        p.min_new_tokens = rng.randint(1, 6)
        p.stop_token_ids = set(rng.sample(range(VOCAB), rng.randint(0, 3))) or None
        p.ignore_eos = rng.random() < 0.3
    return p


def random_reqs(rng: random.Random, n: int, kinds: tuple[str, ...]) -> list[Req]:
    return [
        Req(
            random_params(rng, kinds),
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))],
            [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))],
        )
        for _ in range(n)
    ]


def check(orch: BatchedPenalizerOrchestrator, reqs: list[Req], rng: torch.Generator) -> None:
    logits = torch.randn(len(reqs), VOCAB, generator=rng) * 4
    expected = reference(logits, reqs)
    orch.apply(logits)
    torch.testing.assert_close(logits, expected)


def step(orch: BatchedPenalizerOrchestrator, reqs: list[Req], rng: random.Random) -> None:
    """One decode step: sample a token per request, as the scheduler would record it."""
    new = [rng.randrange(VOCAB) for _ in reqs]
    for req, t in zip(reqs, new):
        req.output_ids.append(t)
    orch.cumulate_output_tokens(torch.tensor(new))


KIND_SETS = [
    ("frequency",),
    ("presence",),
    ("repetition",),
    ("min_new",),
    ("frequency", "presence"),
    ("frequency", "presence", "repetition", "min_new"),
]


@pytest.mark.parametrize("kinds", KIND_SETS, ids="+".join)
@pytest.mark.parametrize("seed", range(4))
def test_matches_reference_over_decode_steps(kinds: tuple[str, ...], seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    reqs = random_reqs(rng, 6, kinds)
    orch = BatchedPenalizerOrchestrator(VOCAB, "cpu", reqs, EOS)
    for _ in range(8):
        check(orch, reqs, gen)
        step(orch, reqs, rng)


def test_unprepared_when_no_request_needs_it() -> None:
    reqs = [Req(Params(), [1, 2, 3], [4]), Req(Params(presence_penalty=0.5), [5], [])]
    orch = BatchedPenalizerOrchestrator(VOCAB, "cpu", reqs, EOS)
    prepared = {type(p) for p in orch.penalizers if p.is_prepared}
    assert prepared == {PresencePenalizer}
    assert all(p._state == {} for p in orch.penalizers if not p.is_prepared)
    assert orch.is_required

    plain = BatchedPenalizerOrchestrator(VOCAB, "cpu", [Req(Params(), [1], [])], EOS)
    assert not plain.is_required
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    plain.apply(logits)
    plain.cumulate_output_tokens(torch.tensor([7]))
    assert torch.equal(logits, before)


def test_min_new_tokens_lifts_after_enough_tokens() -> None:
    req = Req(Params(min_new_tokens=3, stop_token_ids={9}), [1, 2], [])
    ignoring = Req(Params(min_new_tokens=3, stop_token_ids={9}, ignore_eos=True), [1], [])
    orch = BatchedPenalizerOrchestrator(VOCAB, "cpu", [req, ignoring], EOS)
    for generated in range(5):
        logits = torch.zeros(2, VOCAB)
        orch.apply(logits)
        blocked = generated < 3
        assert bool(torch.isinf(logits[0, [2, 3, 9]]).all()) == blocked
        assert bool(torch.isinf(logits[1, 9])) == blocked
        assert torch.isfinite(logits[1, [2, 3]]).all()  # ignore_eos: EOS stays allowed
        assert torch.isfinite(logits[:, [0, 1, 4]]).all()
        orch.cumulate_output_tokens(torch.tensor([5, 5]))


def test_starts_from_existing_output_ids() -> None:
    # A retracted request re-joins with 4 tokens already generated.
    req = Req(Params(frequency_penalty=1.0, min_new_tokens=4), [1], [7, 7, 8, 7])
    orch = BatchedPenalizerOrchestrator(VOCAB, "cpu", [req], EOS)
    logits = torch.zeros(1, VOCAB)
    orch.apply(logits)
    assert logits[0, 7].item() == -3.0 and logits[0, 8].item() == -1.0
    assert torch.isfinite(logits[0, list(EOS)]).all()  # min_new_tokens already reached


@pytest.mark.parametrize("seed", range(6))
def test_filter_and_merge_keep_rows_aligned(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    all_kinds = KIND_SETS[-1]
    # Different penalizer sets on each side exercise merge with one side unprepared.
    left = random_reqs(rng, 4, rng.choice(KIND_SETS))
    right = random_reqs(rng, 3, rng.choice(KIND_SETS))
    a = BatchedPenalizerOrchestrator(VOCAB, "cpu", left, EOS)
    b = BatchedPenalizerOrchestrator(VOCAB, "cpu", right, EOS)
    step(a, left, rng)
    step(b, right, rng)
    a.merge(b)
    reqs = left + right
    assert a.reqs == reqs
    check(a, reqs, gen)
    for _ in range(3):
        step(a, reqs, rng)
        keep = sorted(rng.sample(range(len(reqs)), max(1, len(reqs) - 2)))
        a.filter(torch.tensor(keep) if rng.random() < 0.5 else keep)
        reqs = [reqs[i] for i in keep]
        check(a, reqs, gen)
        extra = random_reqs(rng, 2, all_kinds)
        a.merge(BatchedPenalizerOrchestrator(VOCAB, "cpu", extra, EOS))
        reqs += extra
        check(a, reqs, gen)


def test_filter_tears_down_unused_and_merge_into_empty() -> None:
    reqs = [Req(Params(repetition_penalty=1.3), [1, 2], []), Req(Params(), [3], [4])]
    orch = BatchedPenalizerOrchestrator(VOCAB, "cpu", reqs, EOS)
    assert {type(p) for p in orch.penalizers if p.is_prepared} == {RepetitionPenalizer}
    orch.filter([1])
    assert not orch.is_required

    empty = BatchedPenalizerOrchestrator(VOCAB, "cpu", [], EOS)
    empty.filter([])
    newcomers = [Req(Params(frequency_penalty=0.5, min_new_tokens=2), [1], [6, 6])]
    empty.merge(BatchedPenalizerOrchestrator(VOCAB, "cpu", newcomers, EOS))
    prepared = {type(p) for p in empty.penalizers if p.is_prepared}
    assert prepared == {FrequencyPenalizer, MinNewTokensPenalizer}
    check(empty, newcomers, torch.Generator().manual_seed(0))


def test_rejects_mismatched_logits() -> None:
    orch = BatchedPenalizerOrchestrator(VOCAB, "cpu", [Req(Params(), [1], [])], EOS)
    with pytest.raises(ValueError, match="expected \\(1, 50\\)"):
        orch.apply(torch.zeros(2, VOCAB))
