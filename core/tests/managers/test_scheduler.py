"""The scheduler in-process: continuous batching, chunked prefill, retraction, no KV leak."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.testing.checkpoints import hf_greedy
from engine.testing.harness import OutputCollector, generate_greedy, make_scheduler, submit


def _prompts(seed: int, n: int, lo: int = 2, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_continuous_batching_joins_running_batch(llama_ckpt: str) -> None:
    prompts = _prompts(1, 6)
    alone = [generate_greedy(make_scheduler(llama_ckpt), [p], 12)[0] for p in prompts[:2]]
    sched = make_scheduler(llama_ckpt)
    col = OutputCollector()
    params = {"max_new_tokens": 12, "temperature": 0}
    rids = [submit(sched, prompts[0], params)]
    for _ in range(5):
        sched.step()
    assert len(sched.running_batch.reqs) == 1
    rids.append(submit(sched, prompts[1], params))  # joins while the first decodes
    sched.step()
    assert len(sched.running_batch.reqs) == 2
    rids += [submit(sched, p, params) for p in prompts[2:]]
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    assert [col.ids[r] for r in rids[:2]] == alone
    check_no_leak(sched)


@pytest.mark.parametrize("kwargs", [
    {"chunked_prefill_size": 8},
    {"chunked_prefill_size": 5, "page_size": 4},
    {"disable_radix_cache": True, "chunked_prefill_size": 16},
    {"page_size": 16},
    {"enable_mixed_chunk": True, "chunked_prefill_size": 8},
    {"enable_mixed_chunk": True, "page_size": 4, "chunked_prefill_size": 6},
])
def test_greedy_matches_transformers_under_settings(llama_ckpt: str, hf_llama: Any, kwargs: dict[str, Any]) -> None:
    prompts = _prompts(2, 5)
    sched = make_scheduler(llama_ckpt, **kwargs)
    ours = generate_greedy(sched, prompts, 10)
    assert ours == [hf_greedy(hf_llama, p, 10) for p in prompts]
    check_no_leak(sched)


def test_prefix_cache_hits_keep_outputs(llama_ckpt: str, hf_llama: Any) -> None:
    sched = make_scheduler(llama_ckpt)
    shared = _prompts(3, 1, 40, 40)[0]
    prompts = [shared + tail for tail in ([5], [6, 7], [8, 9, 10])]
    first = generate_greedy(sched, prompts[:1], 8)
    col = OutputCollector()
    rids = [submit(sched, p, {"max_new_tokens": 8, "temperature": 0}) for p in prompts[1:]]
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    assert col.meta[rids[0]]["cached_tokens"] >= 40
    assert [first[0]] + [col.ids[r] for r in rids] == [hf_greedy(hf_llama, p, 8) for p in prompts]
    check_no_leak(sched)


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_keeps_outputs_identical(llama_ckpt: str, page_size: int) -> None:
    prompts = _prompts(4, 8, 20, 40)
    # A stop id makes each request able to end early, so admission reserves only a fraction
    # of its remaining tokens (a request that must run to max_new_tokens reserves them all).
    params = {"ignore_eos": True, "stop_token_ids": [1]}
    reference = generate_greedy(make_scheduler(llama_ckpt), prompts, 40, **params)
    # A pool too small for all eight, and an optimistic admission policy: decode must retract.
    sched = make_scheduler(llama_ckpt, max_total_tokens=320, page_size=page_size, schedule_conservativeness=0.05)
    ours = generate_greedy(sched, prompts, 40, **params)
    assert sched.num_retractions > 0
    assert ours == reference
    check_no_leak(sched)


def test_requests_that_run_to_length_reserve_all_their_tokens(llama_ckpt: str) -> None:
    prompts = _prompts(4, 8, 20, 40)
    reference = generate_greedy(make_scheduler(llama_ckpt), prompts, 40, ignore_eos=True)
    # Same small pool and optimistic ratio, but ignore_eos with no stop conditions: every request
    # needs exactly max_new_tokens, admission reserves that, and nothing is retracted.
    sched = make_scheduler(llama_ckpt, max_total_tokens=320, schedule_conservativeness=0.05)
    ours = generate_greedy(sched, prompts, 40, ignore_eos=True)
    assert sched.num_retractions == 0
    assert ours == reference
    check_no_leak(sched)


def test_mixed_batches_run_decode_rows_with_prefill(llama_ckpt: str, hf_llama: Any) -> None:
    prompts = _prompts(9, 4, 30, 50)
    sched = make_scheduler(llama_ckpt, enable_mixed_chunk=True, chunked_prefill_size=8)
    col = OutputCollector()
    rids = [submit(sched, prompts[0], {"max_new_tokens": 10, "temperature": 0})]
    while sched.chunked_req is not None or sched.waiting_queue:
        sched.step()
    rids += [submit(sched, p, {"max_new_tokens": 10, "temperature": 0}) for p in prompts[1:]]
    before = len(sched.running_batch.reqs[0].output_ids)
    sched.step()  # a prefill chunk of the newcomers, with the running request as a decode row
    assert len(sched.running_batch.reqs[0].output_ids) == before + 1
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    assert [col.ids[r] for r in rids] == [hf_greedy(hf_llama, p, 10) for p in prompts]
    check_no_leak(sched)


def test_random_workload_with_aborts_leaks_nothing(llama_ckpt: str) -> None:
    rng = random.Random(5)
    for kwargs in ({}, {"page_size": 4, "chunked_prefill_size": 12}, {"disable_radix_cache": True},
                   {"enable_mixed_chunk": True, "chunked_prefill_size": 10}):
        sched = make_scheduler(llama_ckpt, max_total_tokens=512, schedule_conservativeness=0.3, **kwargs)
        rids: list[str] = []
        shared = _prompts(6, 1, 30, 30)[0]
        for step in range(120):
            if rng.random() < 0.3:
                p = (shared if rng.random() < 0.5 else []) + _prompts(rng.randrange(10**6), 1, 1, 50)[0]
                rids.append(submit(sched, p, {"max_new_tokens": rng.randint(1, 30), "temperature": 0.8, "seed": step}))
            if rids and rng.random() < 0.1:
                sched.abort_request(rng.choice(rids))
            sched.step()
            sched.take_outputs()
        sched.run_until_idle()
        sched.take_outputs()
        check_no_leak(sched)


def test_abort_during_chunked_prefill_frees_kv(llama_ckpt: str) -> None:
    sched = make_scheduler(llama_ckpt, chunked_prefill_size=8, max_total_tokens=1024)
    rid = submit(sched, _prompts(7, 1, 60, 60)[0], {"max_new_tokens": 5})
    sched.step()
    assert sched.chunked_req is not None
    sched.abort_request(rid, "test")
    sched.run_until_idle()
    (msg,) = [m for m in sched.take_outputs() if rid in m.rids]
    assert msg.finished_reasons[msg.rids.index(rid)] == {"type": "abort", "message": "test"}
    check_no_leak(sched)


def test_invalid_prompt_is_aborted_with_reason(llama_ckpt: str) -> None:
    sched = make_scheduler(llama_ckpt, context_length=64)
    rid = submit(sched, list(range(4, 80)), {})
    (msg,) = sched.take_outputs()
    assert msg.rids == [rid] and "context length is 64" in msg.finished_reasons[0]["message"]


def test_min_new_tokens_and_max_new_tokens(llama_ckpt: str) -> None:
    sched = make_scheduler(llama_ckpt)
    eos = next(iter(sched.eos_token_ids))
    base = generate_greedy(sched, [[5, 6, 7]], 6, ignore_eos=True)[0]
    stop = base[1]
    early = generate_greedy(sched, [[5, 6, 7]], 6, stop_token_ids=[stop])[0]
    assert early[-1] == stop and len(early) == base.index(stop) + 1
    late = generate_greedy(sched, [[5, 6, 7]], 6, stop_token_ids=[stop, eos], min_new_tokens=4)[0]
    assert len(late) >= 4 and stop not in late[:3]


@pytest.mark.parametrize("kwargs", [{}, {"chunked_prefill_size": 5}])
def test_max_new_tokens_zero_is_prompt_only(llama_ckpt: str, hf_llama: Any, kwargs: dict[str, Any]) -> None:
    sched = make_scheduler(llama_ckpt, **kwargs)
    prompt = _prompts(9, 1, 12, 12)[0]
    scored = submit(sched, prompt, {"max_new_tokens": 0, "temperature": 0}, return_logprob=True,
                    top_logprobs_num=2, logprob_start_len=0)
    plain = submit(sched, prompt[:6], {"max_new_tokens": 0})
    sched.run_until_idle()
    msgs = sched.take_outputs()
    rows = [(m, i) for m in msgs for i in range(len(m.rids))]
    assert [m.new_token_ids[i] for m, i in rows] == [[], []]  # one finishing message each, no token
    row = {m.rids[i]: (m, i) for m, i in rows}
    m, i = row[scored]
    assert m.finished_reasons[i] == {"type": "length", "length": 0}
    assert (m.prompt_tokens[i], m.completion_tokens[i]) == (12, 0)
    assert m.output_token_logprobs[i] == []
    prompt_lp = m.input_token_logprobs[i]
    with torch.no_grad():
        ref = torch.log_softmax(hf_llama(torch.tensor([prompt])).logits[0].float(), -1)
    assert prompt_lp[0] == (None, prompt[0]) and len(prompt_lp) == len(prompt)
    for j in range(1, len(prompt)):
        assert abs(prompt_lp[j][0] - ref[j - 1, prompt[j]].item()) < 1e-3
    m, i = row[plain]
    assert m.finished_reasons[i] == {"type": "length", "length": 0} and m.completion_tokens[i] == 0
    check_no_leak(sched)


def test_output_logprobs_match_transformers(llama_ckpt: str, hf_llama: Any) -> None:
    sched = make_scheduler(llama_ckpt)
    prompt = _prompts(8, 1, 12, 12)[0]
    submit(sched, prompt, {"max_new_tokens": 4, "temperature": 0}, return_logprob=True, top_logprobs_num=3,
           logprob_start_len=0)
    sched.run_until_idle()
    msgs = sched.take_outputs()
    out = [t for m in msgs for t in m.output_token_logprobs[0]]
    prompt_lp = next(m.input_token_logprobs[0] for m in msgs if m.input_token_logprobs[0] is not None)
    ids = prompt + [tok for _, tok in out]
    with torch.no_grad():
        ref = torch.log_softmax(hf_llama(torch.tensor([ids])).logits[0].float(), -1)
    for i, (lp, tok) in enumerate(out):
        assert abs(lp - ref[len(prompt) - 1 + i, tok].item()) < 1e-3
    assert prompt_lp[0] == (None, prompt[0]) and len(prompt_lp) == len(prompt)
    for j in range(1, len(prompt)):
        assert abs(prompt_lp[j][0] - ref[j - 1, prompt[j]].item()) < 1e-3
    top = [t for m in msgs for t in m.output_top_logprobs[0]]
    assert len(top[0]) == 3 and top[0][0][1] == out[0][1]


def test_penalties_change_outputs_and_counts_carry(llama_ckpt: str) -> None:
    sched = make_scheduler(llama_ckpt)
    prompt = [5, 6, 7, 8]
    plain = generate_greedy(sched, [prompt], 20, ignore_eos=True)[0]
    rep = generate_greedy(sched, [prompt], 20, ignore_eos=True, frequency_penalty=2.0)[0]
    assert plain != rep
    # Frequency penalty 2.0 on these logits forbids immediate repetition loops.
    assert max(rep.count(t) for t in set(rep)) <= max(plain.count(t) for t in set(plain))


@pytest.mark.parametrize("kwargs", [{}, {"page_size": 4}, {"max_total_tokens": 320, "schedule_conservativeness": 0.05}])
def test_overlap_schedule_gives_identical_outputs(llama_ckpt: str, kwargs: dict[str, Any]) -> None:
    """Overlap (launch N+1 before processing N) is exercised on the CPU by forcing it on."""
    prompts = _prompts(10, 8, 10, 40)
    rng = random.Random(11)
    params = [{"max_new_tokens": rng.randint(3, 30), "temperature": rng.choice([0.0, 0.9]), "seed": i,
               "ignore_eos": rng.random() < 0.5, "frequency_penalty": rng.choice([0.0, 0.5])}
              for i in range(len(prompts))]
    outputs = []
    for overlap in (False, True):
        sched = make_scheduler(llama_ckpt, **kwargs)
        sched.enable_overlap = overlap
        col = OutputCollector()
        rids = [submit(sched, p, sp) for p, sp in zip(prompts[:5], params)]
        for _ in range(12):
            sched.step()
            col.collect(sched)
        if overlap:
            assert sched.forward_steps > 0
        rids += [submit(sched, p, sp) for p, sp in zip(prompts[5:], params[5:])]
        sched.abort_request(rids[1], "test abort")
        while sched.step():
            col.collect(sched)
        col.collect(sched)
        check_no_leak(sched)
        outputs.append(([col.ids.get(r) for r in rids], [col.finish.get(r) for r in rids]))
    assert outputs[0] == outputs[1]


def test_overlap_stays_on_while_requests_wait(llama_ckpt: str) -> None:
    """Requests queued behind a full pool must not force every decode step to be synchronous."""
    sched = make_scheduler(llama_ckpt, max_total_tokens=320)
    sched.enable_overlap = True
    for p in _prompts(12, 10, 20, 30):
        submit(sched, p, {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True})
    overlapped_while_waiting = 0
    while True:
        waiting, before = bool(sched.waiting_queue), sched.overlapped_decode_steps
        if not sched.step():
            break
        overlapped_while_waiting += waiting and sched.overlapped_decode_steps > before
    check_no_leak(sched)
    assert overlapped_while_waiting > 10


def test_sampling_state_is_not_reused_across_requests(llama_ckpt: str) -> None:
    """A finished request's batched sampling state must never be applied to a new request."""
    sched = make_scheduler(llama_ckpt)
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    first = generate_greedy(sched, [[5, 6, 7]], 8, **{k: v for k, v in sampled.items() if k != "max_new_tokens"})[0]
    for _ in range(5):  # greedy requests in between leave a greedy batch state behind
        generate_greedy(sched, [[5, 6, 7]], 8, ignore_eos=True)
        again = generate_greedy(sched, [[5, 6, 7]], 8, **{k: v for k, v in sampled.items() if k != "max_new_tokens"})[0]
        assert again == first


def test_parallel_samples_share_the_prompt_kv(llama_ckpt: str) -> None:
    """n > 1: copies of one prompt are prefilled once; the others hit the prefix cache."""
    sched = make_scheduler(llama_ckpt)
    prompt = _prompts(12, 1, 40, 40)[0]
    col = OutputCollector()
    rids = [submit(sched, prompt, {"max_new_tokens": 6, "temperature": 1.0, "seed": i}) for i in range(4)]
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    cached = sorted(col.meta[r]["cached_tokens"] for r in rids)
    assert cached[0] == 0 and all(c >= len(prompt) - 1 for c in cached[1:]), cached
    assert len({tuple(col.ids[r]) for r in rids}) > 1
    check_no_leak(sched)
