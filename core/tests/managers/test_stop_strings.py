"""Stop strings end a request in the scheduler at the step whose token completes them.

A tiny random Llama on the CPU, the scheduler in-process and its messages passed through the
detokenizer (no server): the token count, the finish reason and the text must all stop at the
first token whose text completes a stop string, whether it is the first token, lies inside one
token's text, spans two tokens, arrives in a streamed request, an overlapped decode step or a
run of accepted speculative drafts.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.managers.detokenizer_manager import DetokenizerManager
from engine.managers.scheduler import check_no_leak
from engine.managers.stop_strings import StopStringCheck
from engine.sampling.sampling_params import SamplingParams
from engine.testing.harness import generate_greedy, make_scheduler, submit
from engine.testing.proposers import OracleProposer

PROMPT = [5, 6, 7, 8, 9]
MAX_NEW = 16


@pytest.fixture(scope="module")
def tok(llama_ckpt: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_ckpt)


@pytest.fixture(scope="module")
def sched(llama_ckpt: str) -> Any:
    return make_scheduler(llama_ckpt)


@pytest.fixture(scope="module")
def base(sched: Any) -> list[int]:
    """The greedy continuation of PROMPT, run to MAX_NEW tokens."""
    out = generate_greedy(sched, [PROMPT], MAX_NEW, ignore_eos=True)[0]
    assert len(out) == MAX_NEW
    return out


def _run(sched: Any, tok: Any, params: dict[str, Any], prompt: list[int] = PROMPT,
         stream: bool = False) -> dict[str, Any]:
    """One request through the scheduler and the detokenizer: ids, text, finish reason, usage."""
    detok = DetokenizerManager(tok)
    sp = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True, **params}
    rid = submit(sched, prompt, sp, stream=stream)
    # "generated": every token the scheduler sent, also any the detokenizer drops after a finish.
    got: dict[str, Any] = {"ids": [], "text": "", "pieces": [], "reason": None, "generated": 0}
    while True:
        busy = sched.step()
        for msg in sched.take_outputs():
            got["generated"] += sum(len(ids) for ids in msg.new_token_ids)
            out = detok.handle(msg)
            for i, r in enumerate(out.rids):
                assert r == rid and got["reason"] is None, "a message after the finish"
                got["ids"] += out.new_token_ids[i]
                got["text"] += out.new_texts[i]
                got["pieces"].append(out.new_texts[i])
                got["reason"] = out.finished_reasons[i]
                got["completion_tokens"] = out.completion_tokens[i]
        if not busy:
            break
    check_no_leak(sched)
    return got


def _first_match(tok: Any, ids: list[int], stop: str) -> int:
    """Tokens up to and including the first whose text completes ``stop`` (the oracle)."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


def _assert_stopped(got: dict[str, Any], tok: Any, base: list[int], stop: str) -> None:
    k = _first_match(tok, base, stop)
    assert got["ids"] == base[:k]
    assert got["completion_tokens"] == got["generated"] == k
    assert got["reason"] == {"type": "stop", "matched": stop}
    full = tok.decode(base[:k])
    assert got["text"] == full[: full.index(stop)]


def test_first_token_text_stops_after_one_token(sched: Any, tok: Any, base: list[int]) -> None:
    stop = tok.decode(base[:1])
    got = _run(sched, tok, {"stop": stop})
    assert got["ids"] == base[:1] and got["completion_tokens"] == got["generated"] == 1 and got["text"] == ""
    assert got["reason"] == {"type": "stop", "matched": stop}


def test_stop_inside_first_token_text(sched: Any, tok: Any, base: list[int]) -> None:
    first = tok.decode(base[:1])
    assert len(first) >= 3, f"first token text {first!r} is too short to hold a stop string inside"
    stop = first[1:-1]
    got = _run(sched, tok, {"stop": stop})
    _assert_stopped(got, tok, base, stop)
    assert got["completion_tokens"] == 1 and got["text"] == first[:1]


def test_stop_spanning_two_tokens(sched: Any, tok: Any, base: list[int]) -> None:
    # The end of token j's text and the start of token j+1's, for the first j where that pair
    # is not already in the earlier text: the match completes on token j+1, not before.
    for j in range(MAX_NEW - 1):
        left, right = tok.decode(base[j : j + 1]), tok.decode(base[j + 1 : j + 2])
        stop = left[-2:] + right[:2]
        if left and right and stop not in tok.decode(base[: j + 1]):
            break
    else:
        pytest.fail(f"no two-token stop string in {tok.decode(base)!r}")
    got = _run(sched, tok, {"stop": [stop, "never appears \u2603"]})
    _assert_stopped(got, tok, base, stop)
    assert got["completion_tokens"] == j + 2


def test_streamed_request_stops_at_the_match(sched: Any, tok: Any, base: list[int]) -> None:
    stop = tok.decode(base[5:6])
    got = _run(sched, tok, {"stop": stop}, stream=True)
    _assert_stopped(got, tok, base, stop)
    assert len(got["pieces"]) == got["completion_tokens"]  # one message per token, none after


def test_no_stop_trim_keeps_the_stop_string(sched: Any, tok: Any, base: list[int]) -> None:
    stop = tok.decode(base[3:5])
    got = _run(sched, tok, {"stop": stop, "no_stop_trim": True})
    k = _first_match(tok, base, stop)
    full = tok.decode(base[:k])
    assert got["completion_tokens"] == got["generated"] == k
    assert got["text"] == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_count_tokens_up_to_the_stop(sched: Any, tok: Any, base: list[int]) -> None:
    stop_id = base[4]
    got = _run(sched, tok, {"stop_token_ids": [stop_id]})
    k = base.index(stop_id) + 1
    assert got["ids"] == base[:k] and got["completion_tokens"] == got["generated"] == k
    assert got["reason"] == {"type": "stop", "matched": stop_id}


def test_overlapped_decode_stops_at_the_match(llama_ckpt: str, tok: Any, base: list[int]) -> None:
    sched = make_scheduler(llama_ckpt)
    sched.enable_overlap = True  # the CPU platform does not turn it on by itself
    stop = tok.decode(base[6:7])
    _assert_stopped(_run(sched, tok, {"stop": stop}), tok, base, stop)


def test_speculative_run_ends_at_the_first_match(llama_ckpt: str, tok: Any, base: list[int]) -> None:
    # Every draft is accepted: runs of 5 tokens after the prefill's one (tokens 2-6, 7-11), so a
    # stop string completed by token 4 lies inside one verify step's accepted run.
    sched = make_scheduler(llama_ckpt, speculative_algorithm="ngram", speculative_num_steps=4)
    sched.speculator.proposer = OracleProposer([PROMPT], [base])
    stop = tok.decode(base[3:4])
    k = _first_match(tok, base, stop)
    assert 2 < k < 6, f"stop string {stop!r} first completes at token {k}, not inside the first run"
    got = _run(sched, tok, {"stop": stop})
    _assert_stopped(got, tok, base, stop)
    assert sched.speculator.stats.accepted_tokens > 0


def test_check_agrees_with_the_detokenizer_token_by_token(tok: Any, base: list[int]) -> None:
    # The scheduler's check reports a match at exactly the token where the full decode first
    # holds the stop string, and nothing before.
    stop = tok.decode(base[2:4])[1:]
    check = StopStringCheck(tok, SamplingParams(stop=[stop]), PROMPT)
    hits = [check.feed(base[:k]) for k in range(1, MAX_NEW + 1)]
    k = _first_match(tok, base, stop)
    assert hits[: k - 1] == [None] * (k - 1) and hits[k - 1] == stop


def test_stop_strings_without_a_tokenizer_are_refused() -> None:
    # --skip-tokenizer-init: no text exists to match in, so a stop string is a request error
    # naming the field, not silently ignored; stop_token_ids still work there.
    from types import SimpleNamespace

    from engine.managers.tokenizer_manager import GenerateRequest, RequestError, TokenizerManager

    manager = SimpleNamespace(tokenizer=None, context_len=64, _check_structured=lambda params: None,
                              check_generation_task=lambda what: None,
                              lora=SimpleNamespace(resolve=lambda value: None))
    req = GenerateRequest(input_ids=[5, 6], sampling_params={"stop": "\n"})
    with pytest.raises(RequestError, match=r"stop: invalid value \['\\n'\].*--skip-tokenizer-init.*stop_token_ids") as info:
        TokenizerManager.validate(manager, req, [5, 6])  # type: ignore[arg-type]
    assert info.value.field == "stop"
    ok = GenerateRequest(input_ids=[5, 6], sampling_params={"stop_token_ids": [7]})
    assert TokenizerManager.validate(manager, ok, [5, 6]).stop_token_ids == [7]  # type: ignore[arg-type]
