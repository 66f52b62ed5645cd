"""The language on ``engine serve`` (default model, CPU) through ``RuntimeEndpoint``: each result
checked against requests sent to the native API by hand."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from engine_lang import ProgramError, assistant, function, gen, select, system, user
from lang_programs import check_seed_patterns

PROMPT = "The capital of France is"


def native(server: Any, body: dict[str, Any]) -> Any:
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@function
def answer(s: Any, prompt: str, stop: str | None) -> None:
    s += prompt
    s += gen("answer", max_tokens=12, stop=stop)


@pytest.mark.parametrize("stop", [None, "."])
def test_gen_equals_native_generate(server: Any, endpoint: Any, stop: str | None) -> None:
    state = answer.run(PROMPT, stop, temperature=0, backend=endpoint)
    params: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0}
    if stop:
        params["stop"] = stop
    by_hand = native(server, {"text": PROMPT, "sampling_params": params})
    assert state["answer"] == by_hand["text"]
    assert state.text() == PROMPT + by_hand["text"]
    meta = state.get_meta_info("answer")
    assert meta["finish_reason"]["type"] == by_hand["meta_info"]["finish_reason"]["type"]
    assert meta["completion_tokens"] == by_hand["meta_info"]["completion_tokens"]
    if stop:
        assert "." not in state["answer"] and meta["finish_reason"] == {"type": "stop", "matched": "."}


# -- select: the choice with the best score, scored independently from /generate ---------------
CASES = {
    "single-token": ("Q: What color is the sky on a clear day?\nA: The sky is", [" blue", " green", " red"]),
    "shared-prefix": ("Q: Where is the Eiffel Tower?\nA: It is in", [" Paris, France", " Paris, Texas", " Rome, Italy"]),
}


_independent: dict[tuple[str, str], tuple[list[float], list[float]]] = {}


def _independent_logprobs(server: Any, prefix: str, choice: str) -> tuple[list[float], list[float]]:
    """The choice's token logprobs after the prefix and alone, each from its own request (asked
    once per module: every choices method is checked against the same scores)."""
    if (prefix, choice) not in _independent:
        _independent[prefix, choice] = _ask_independent_logprobs(server, prefix, choice)
    return _independent[prefix, choice]


def _ask_independent_logprobs(server: Any, prefix: str, choice: str) -> tuple[list[float], list[float]]:
    prefix_ids = httpx.post(server.url + "/v1/tokenize", json={"prompt": prefix}).json()["tokens"]
    out = native(server, {"text": prefix + choice, "sampling_params": {"max_new_tokens": 0},
                          "return_logprob": True, "logprob_start_len": 0})
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries[:len(prefix_ids)]] == prefix_ids  # the choice does not merge with the prefix
    alone = native(server, {"text": choice, "sampling_params": {"max_new_tokens": 0},
                            "return_logprob": True, "logprob_start_len": 0})
    return [e[0] for e in entries[len(prefix_ids):]], [e[0] or 0.0 for e in alone["meta_info"]["input_token_logprobs"]]


def _expected(method: str, rows: list[tuple[list[float], list[float]]]) -> tuple[int, list[float]]:
    if method == "token_length_normalized":
        scores = [sum(c) / len(c) for c, _ in rows]
    elif method == "unconditional_likelihood_normalized":
        scores = [sum(c) / len(c) - sum(u) / len(u) for c, u in rows]
    else:  # greedy: walk token by token among the choices still tied (1e-4: batched float noise)
        width = max(len(c) for c, _ in rows)
        matrix = [c + [sum(c) / len(c)] * (width - len(c)) for c, _ in rows]
        alive = list(range(len(rows)))
        for j in range(width):
            best = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] >= best - 1e-4]
            if len(alive) == 1:
                break
        return alive[0], [m[0] for m in matrix]
    return max(range(len(scores)), key=scores.__getitem__), scores


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token_selection",
                                    "unconditional_likelihood_normalized"])
def test_select_picks_the_best_independent_score(server: Any, endpoint: Any, case: str, method: str) -> None:
    prefix, choices = CASES[case]

    @function
    def choose(s: Any) -> None:
        s += prefix
        s += select("choice", choices=choices, choices_method=method)

    state = choose.run(backend=endpoint)
    index, scores = _expected(method, [_independent_logprobs(server, prefix, c) for c in choices])
    assert state["choice"] == choices[index]
    assert state.text() == prefix + choices[index]
    assert state.get_meta_info("choice")["scores"] == pytest.approx(scores, abs=2e-2)


def test_select_is_one_scoring_request_without_sampling(server: Any, endpoint: Any) -> None:
    # The choices' prompts come after the prefix hint, so the scoring request finds it cached.
    prefix, choices = CASES["single-token"]

    @function
    def choose(s: Any) -> None:
        s += prefix
        s += select("c", choices=choices)

    state = choose.run(backend=endpoint)
    meta = state.get_meta_info("c")
    assert meta["prefix_tokens"] > 0 and all(c >= meta["prefix_tokens"] - 1 for c in meta["cached_tokens"])
    assert [len(t) for t in meta["input_token_logprobs"]] == [1, 1, 1]


# -- fork ---------------------------------------------------------------------------------------
@function
def tips(s: Any, n: int) -> None:
    s += "Here are some tips for staying healthy:\n"
    forks = s.fork(n)
    for i, f in enumerate(forks):
        f += f"{i + 1}."
        f += gen("tip", max_tokens=16, ignore_eos=True)
    forks.join()


def test_fork_branches_run_concurrently_from_the_cache(server: Any, endpoint: Any) -> None:
    # Concurrency shows in the server's decode steps: four branches of 16 tokens decoded together
    # take about 16 steps, one after another 64. (Wall time on a shared CPU says less: a batch of
    # four costs more than one row there.)
    endpoint.calls.clear()
    steps = server.get("/get_server_info").json()["decode_steps"]
    start = time.monotonic()
    state = tips.run(4, temperature=0, backend=endpoint)
    wall = time.monotonic() - start
    steps = server.get("/get_server_info").json()["decode_steps"] - steps
    spans = [(s, e) for _, s, e in endpoint.calls]
    assert len(spans) == 4 and max(s for s, _ in spans) < min(e for _, e in spans)  # all four in flight at once
    assert steps <= 2 * 16, (steps, wall)
    metas = state.get_meta_info("tip")
    assert all(m["cached_tokens"] > 0 for m in metas), metas  # the prefix hint put the prefix in the cache
    assert len(state["tip"]) == 4 and all(state["tip"])


# -- run_batch ----------------------------------------------------------------------------------
@function
def count(s: Any, i: int) -> None:
    s += f"Count from {i}:"
    s += gen("next", max_tokens=4, temperature=-1.0 if i == 13 else 0.0)


def test_run_batch_of_32_keeps_every_result(server: Any, endpoint: Any) -> None:
    states = count.run_batch([{"i": i} for i in range(32)], num_threads=32, backend=endpoint)
    by_hand = native(server, {"text": [f"Count from {i}:" for i in range(32) if i != 13],
                              "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    expected = iter(out["text"] for out in by_hand)
    for i, state in enumerate(states):
        if i == 13:
            error = state.error()
            assert isinstance(error, ProgramError) and error.variable == "next" and "temperature" in str(error)
            with pytest.raises(ProgramError, match="variable 'next'"):
                state["next"]
        else:
            assert state.error() is None and state["next"] == next(expected), i


INSTRUCTION = "Answer with one word. Say which of the following animals is the largest one.\n"


@function
def largest(s: Any, animals: str) -> None:
    s += INSTRUCTION
    s += f"Animals: {animals}\nAnswer:"
    s += gen("answer", max_tokens=2)


def test_run_batch_sends_the_shared_prefix_first(endpoint: Any) -> None:
    from engine_lang.program import trace_prefix

    assert trace_prefix(largest, endpoint) == INSTRUCTION  # ends where the first argument is used
    instruction_tokens = httpx.post(endpoint.base_url + "/v1/tokenize", json={"prompt": INSTRUCTION}).json()["count"]
    states = largest.run_batch([{"animals": a} for a in ("cat, whale", "ant, dog", "cow, mouse", "fox, bear")],
                               temperature=0, backend=endpoint)
    for state in states:
        assert state.get_meta_info("answer")["cached_tokens"] >= instruction_tokens - 1


# -- streaming, roles ---------------------------------------------------------------------------
@function
def chat(s: Any, question: str) -> None:
    s += system("You are a helpful assistant.")
    s += user(question)
    s += assistant(gen("reply", max_tokens=12))


def test_stream_yields_the_same_text(endpoint: Any) -> None:
    import asyncio

    plain = chat.run("What is 2+2?", temperature=0, backend=endpoint)
    streamed = chat.run("What is 2+2?", temperature=0, stream=True, backend=endpoint)
    assert "".join(streamed.text_iter("reply")) == plain["reply"]
    assert streamed.text() == plain.text()
    again = chat.run("What is 2+2?", temperature=0, stream=True, backend=endpoint)

    async def collect() -> str:
        return "".join([piece async for piece in again.text_async_iter()])

    assert asyncio.run(collect()) == plain.text()


def test_roles_render_as_transformers_apply_chat_template(endpoint: Any, tokenizer: Any) -> None:
    @function
    def turns(s: Any) -> None:
        s += user("Hello!")
        s += assistant("Hi. How can I help?")
        with s.user():
            s += "Name a "
            s += "fruit."
        s += assistant(gen("fruit", max_tokens=6))

    endpoint.calls.clear()
    state = turns.run(temperature=0, backend=endpoint)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert state.text() == tokenizer.apply_chat_template(messages, tokenize=False)
    (req, _, _), = endpoint.calls
    assert req.text == tokenizer.apply_chat_template(messages[:3], tokenize=False, add_generation_prompt=True)
    with_system = chat.run("Hi", temperature=0, backend=endpoint)
    assert with_system.text() == tokenizer.apply_chat_template(with_system.messages(), tokenize=False)


# -- errors -------------------------------------------------------------------------------------
def test_failed_call_names_the_variable_and_the_call(endpoint: Any) -> None:
    @function
    def bad(s: Any) -> None:
        s += "Digits:"
        s += gen("digits", max_tokens=4, regex="([0-9]")

    with pytest.raises(ProgramError) as info:
        bad.run(backend=endpoint)
    assert info.value.variable == "digits" and "gen('digits'" in str(info.value) and "regex" in str(info.value)


@pytest.mark.parametrize("interrupt", [RuntimeError, KeyboardInterrupt])
def test_a_program_that_fails_leaves_no_request_running(server: Any, endpoint: Any, interrupt: type) -> None:
    @function
    def long_branch(s: Any) -> None:
        s += "Write a long story:"
        branch = s.fork(1)[0]
        branch += gen("story", max_tokens=2000, ignore_eos=True)
        deadline = time.monotonic() + 60
        while server.get("/get_server_info").json()["num_running_reqs"] == 0:
            assert time.monotonic() < deadline, "the branch's request never started"
            time.sleep(0.05)
        raise interrupt("stop here")

    with pytest.raises(interrupt, match="stop here"):
        long_branch.run(temperature=0, backend=endpoint)
    _wait_until_nothing_runs(server)


def _wait_until_nothing_runs(server: Any) -> None:
    deadline = time.monotonic() + 10  # an abort takes effect at the scheduler's next step
    while (info := server.get("/get_server_info").json())["num_running_reqs"] or info["num_waiting_reqs"]:
        assert time.monotonic() < deadline, "a request kept running after the program stopped"
        time.sleep(0.05)


def test_ctrl_c_while_reading_a_stream_stops_the_program(server: Any, endpoint: Any) -> None:
    @function
    def story(s: Any) -> None:
        s += "Write a long story:"
        s += gen("story", max_tokens=2000, ignore_eos=True)

    state = story.run(temperature=0, stream=True, backend=endpoint)
    pieces = state.text_iter("story")
    next(pieces)  # generating now
    with pytest.raises(KeyboardInterrupt):
        pieces.throw(KeyboardInterrupt)  # as Ctrl-C arrives while the reader waits for text
    with pytest.raises(ProgramError, match="variable 'story'"):
        state.text()
    _wait_until_nothing_runs(server)


# -- the seed documents' patterns, unchanged ------------------------------------------------------
def test_seed_patterns_run_unchanged(endpoint: Any) -> None:
    check_seed_patterns(endpoint)
