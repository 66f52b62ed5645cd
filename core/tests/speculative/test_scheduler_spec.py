"""Speculative decode steps inside the scheduler, on a tiny random Llama (CPU): exact greedy
output with any proposer, KV bookkeeping (no leak) under prefix-cache hits, chunked prefill and
a tight pool, finishing inside an accepted run, fall-backs and start-up refusals."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.errors import ConfigError, PluginError
from engine.managers.scheduler import check_no_leak
from engine.speculative import Proposer
from engine.testing.harness import OutputCollector, generate_greedy, make_scheduler, submit
from engine.testing.proposers import OracleProposer, RandomProposer


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    phrase = [rng.randrange(2048) for _ in range(16)]
    return [phrase * 3, [rng.randrange(2048) for _ in range(5)], [rng.randrange(2048) for _ in range(70)],
            phrase[:9] + [3, 4] * 6, [rng.randrange(2048) for _ in range(33)]]


@pytest.fixture(scope="module")
def expected(llama_ckpt: str, prompts: list[list[int]]) -> list[list[int]]:
    return generate_greedy(make_scheduler(llama_ckpt), prompts, 30)


def _spec(path: str, proposer: Proposer | None = None, **kw: Any) -> Any:
    sched = make_scheduler(path, speculative_algorithm="ngram", **kw)
    if proposer is not None:
        sched.speculator.proposer = proposer
    return sched


def test_ngram_equals_plain_with_prefix_hits(llama_ckpt: str, prompts: list[list[int]],
                                             expected: list[list[int]]) -> None:
    sched = _spec(llama_ckpt, speculative_num_steps=5)
    assert not sched.enable_overlap
    for _ in range(2):  # the second round hits the prefix cache
        assert generate_greedy(sched, prompts, 30) == expected
    assert sched.speculator.stats.verify_steps > 0
    check_no_leak(sched)


def test_oracle_proposer_is_accepted_in_full(llama_ckpt: str, prompts: list[list[int]],
                                             expected: list[list[int]]) -> None:
    k = 4
    sched = _spec(llama_ckpt, OracleProposer(prompts, expected), speculative_num_steps=k)
    assert generate_greedy(sched, prompts, 30) == expected
    st = sched.speculator.stats
    assert st.accepted_tokens == st.proposed_tokens > 0
    # 29 decode tokens per request (the first comes from the prefill) in runs of k + 1.
    assert st.verify_steps == -(-29 // (k + 1))
    check_no_leak(sched)


def test_random_proposer_still_exact(llama_ckpt: str, prompts: list[list[int]], expected: list[list[int]]) -> None:
    sched = _spec(llama_ckpt, RandomProposer(), speculative_num_steps=6)
    assert generate_greedy(sched, prompts, 30) == expected
    check_no_leak(sched)


@pytest.mark.parametrize("kw", [
    {"chunked_prefill_size": 16},
    {"max_total_tokens": 160, "chunked_prefill_size": 32},  # tight: retraction
    {"disable_radix_cache": True},
])
def test_exact_under_chunking_tight_pool_and_chunk_cache(llama_ckpt: str, prompts: list[list[int]],
                                                         expected: list[list[int]], kw: dict[str, Any]) -> None:
    sched = _spec(llama_ckpt, OracleProposer(prompts, expected), speculative_num_steps=7, **kw)
    assert generate_greedy(sched, prompts, 30) == expected
    check_no_leak(sched)


def test_finish_inside_accepted_run(llama_ckpt: str, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """max_new_tokens and a stop token met in the middle of a fully accepted run end the
    request at that token (the oracle drafts past it)."""
    sched = _spec(llama_ckpt, OracleProposer(prompts, expected), speculative_num_steps=8)
    stop_at = expected[0][6]
    first = expected[0].index(stop_at)
    col = OutputCollector()
    a = submit(sched, prompts[0], {"max_new_tokens": 30, "temperature": 0.0, "stop_token_ids": [stop_at]})
    b = submit(sched, prompts[2], {"max_new_tokens": 12, "temperature": 0.0})
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    assert col.ids[a] == expected[0][: first + 1]
    assert col.finish[a]["type"] == "stop"
    assert col.ids[b] == expected[2][:12]
    assert col.finish[b] == {"type": "length", "length": 12}
    check_no_leak(sched)


def test_penalized_batches_decode_plainly(llama_ckpt: str, prompts: list[list[int]]) -> None:
    params = {"frequency_penalty": 0.5}
    plain = generate_greedy(make_scheduler(llama_ckpt), prompts[:2], 16, **params)
    sched = _spec(llama_ckpt)
    assert generate_greedy(sched, prompts[:2], 16, **params) == plain
    assert sched.speculator.stats.fallback_steps > 0 and sched.speculator.stats.verify_steps == 0


def test_batches_above_the_threshold_decode_plainly(llama_ckpt: str, prompts: list[list[int]],
                                                    expected: list[list[int]]) -> None:
    sched = _spec(llama_ckpt, speculative_max_batch_size=2)
    assert generate_greedy(sched, prompts, 30) == expected
    assert sched.speculator.stats.fallback_steps > 0


def test_sampling_runs_and_frees_kv(llama_ckpt: str, prompts: list[list[int]]) -> None:
    sched = _spec(llama_ckpt, RandomProposer(1))
    rids = [submit(sched, p, {"max_new_tokens": 20, "temperature": 0.9, "top_p": 0.9, "min_p": 0.01}) for p in prompts]
    col = OutputCollector()
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    assert all(len(col.ids[r]) == 20 for r in rids)
    check_no_leak(sched)


@pytest.mark.parametrize("kw, match", [
    ({"pp_size": 2}, "--pp-size 2"),
    ({"page_size": 16}, "--page-size 16"),
    ({"speculative_eagle_topk": 4}, "--speculative-eagle-topk: invalid value 4 .* drafts chains only"),
    ({"speculative_eagle_topk": 0}, "--speculative-eagle-topk: invalid value 0"),
    ({"speculative_num_steps": 0}, "--speculative-num-steps"),
])
def test_unsupported_combinations_refused_at_start(llama_ckpt: str, kw: dict[str, Any], match: str) -> None:
    from engine.config import ServerArgs

    with pytest.raises(ConfigError, match=match):
        ServerArgs.from_dict({"model_path": llama_ckpt, "speculative_algorithm": "ngram", **kw})


def test_unknown_algorithm_names_the_installed_ones(llama_ckpt: str) -> None:
    from engine.config import ServerArgs

    with pytest.raises(PluginError, match="--speculative-algorithm: unknown speculative algorithm 'ngrm'.*ngram"):
        ServerArgs.from_dict({"model_path": llama_ckpt, "speculative_algorithm": "ngrm"})


def test_acceptance_stats_reach_the_outputs(llama_ckpt: str, prompts: list[list[int]],
                                             expected: list[list[int]]) -> None:
    sched = _spec(llama_ckpt, OracleProposer(prompts, expected), speculative_num_steps=4)
    rid = submit(sched, prompts[0], {"max_new_tokens": 30, "temperature": 0.0})
    verify, kept = 0, 0
    while sched.step():
        for msg in sched.take_outputs():
            assert msg.spec_verify_ct is not None
            i = msg.rids.index(rid)
            verify, kept = msg.spec_verify_ct[i], msg.spec_accepted_tokens[i]
    assert (verify, kept) == (6, 23)  # 29 decode tokens: 5 runs of 4 drafts + 1, then 3 drafts + 1
    stats = sched.stats()
    assert stats["spec_verify_steps"] == 6 and stats["spec_emitted_tokens"] == 29
    assert stats["spec_mean_accept_length"] == pytest.approx(29 / 6)


def test_rows_that_cannot_draft_ride_along(llama_ckpt: str, prompts: list[list[int]],
                                           expected: list[list[int]]) -> None:
    """A penalized row, a logprob row and a min_new_tokens row share the verify forward with
    drafting rows: they take one sampler token per step (as plain decode would), the others
    verify chains; every output equals the engine without speculation."""
    special = [{"frequency_penalty": 0.7, "presence_penalty": 0.3}, {"repetition_penalty": 1.3},
               {"min_new_tokens": 25}]
    greedy = {"max_new_tokens": 30, "temperature": 0.0}

    def run(sched: Any) -> tuple[dict[int, list[int]], dict[int, Any]]:
        rids = {}
        for i, p in enumerate(prompts):
            extra = special[i] if i < len(special) else {}
            rids[i] = submit(sched, p, {**greedy, **extra}, return_logprob=(i == 3))
        col = OutputCollector()
        while sched.step():
            col.collect(sched)
        col.collect(sched)
        return {i: col.ids[r] for i, r in rids.items()}, col

    plain_out, _ = run(make_scheduler(llama_ckpt))
    sched = _spec(llama_ckpt, OracleProposer(prompts, expected), speculative_num_steps=4)
    spec_out, _ = run(sched)
    assert spec_out == plain_out
    assert spec_out[4] == expected[4]  # an ordinary greedy row
    st = sched.speculator.stats
    assert st.verify_steps > 0 and st.accepted_tokens > 0
    check_no_leak(sched)


def test_draft_model_proposers_refuse_tensor_parallelism(llama_ckpt: str) -> None:
    from engine.config import ServerArgs

    with pytest.raises(ConfigError, match="--tp-size 2"):
        ServerArgs.from_dict({"model_path": llama_ckpt, "speculative_algorithm": "draft",
                              "speculative_draft_model_path": llama_ckpt, "tp_size": 2})


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
def test_batches_above_the_limit_overlap_and_verify_once_small(llama_ckpt: str, prompts: list[list[int]],
                                                               expected: list[list[int]], proposer: str) -> None:
    """With overlap scheduling on, decode steps of a batch above --speculative-max-batch-size run
    overlapped (no drafts); once requests finish and the batch fits, the in-flight step is
    settled and verify steps take over. Greedy output equals plain decoding throughout."""
    sched = _spec(llama_ckpt, OracleProposer(prompts, expected) if proposer == "oracle" else None,
                  speculative_num_steps=4, speculative_max_batch_size=2)
    sched.enable_overlap = True  # the CPU platform does not turn it on by itself
    lengths = [6, 9, 30, 12, 27]  # the batch shrinks from 5 rows to 2 as requests end
    rids = [submit(sched, p, {"max_new_tokens": n, "temperature": 0.0}) for p, n in zip(prompts, lengths)]
    col = OutputCollector()
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    assert [col.ids[r] for r in rids] == [e[:n] for e, n in zip(expected, lengths)]
    st = sched.speculator.stats
    assert sched.overlapped_decode_steps > 0 and st.fallback_steps > 0 and st.verify_steps > 0
    if proposer == "oracle":
        assert st.accepted_tokens == st.proposed_tokens > 0
    check_no_leak(sched)
