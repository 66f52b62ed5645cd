"""The language on an in-process engine (``engine_lang.Engine``, default model, CPU): the kit,
and the same programs as on the server (equal greedy results to ``RuntimeEndpoint`` on the
session's default-model server), checked against the engine's own ``generate``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from engine_lang import Engine, assistant, function, gen, select, system, user
from engine_lang.testing import BackendConformance
from lang_programs import (
    Recording,
    check_same_greedy_results,
    check_seed_patterns,
    conversation,
    program,
)


class RecordingEngine(Recording, Engine):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = []


@pytest.fixture(scope="module")
def engine_backend() -> Iterator[Engine]:
    with RecordingEngine(max_total_tokens=16384) as backend:
        yield backend


class TestEngineConformance(BackendConformance):
    @pytest.fixture(scope="class")
    def backend(self, engine_backend: Engine) -> Engine:
        return engine_backend


@function
def answer(s: Any, prompt: str) -> None:
    s += prompt
    s += gen("answer", max_tokens=12, stop=".")


@function
def chat(s: Any, question: str) -> None:
    s += system("You are a helpful assistant.")
    s += user(question)
    s += assistant(gen("reply", max_tokens=12))


def _by_hand(backend: Engine, text: str, params: dict[str, Any]) -> dict[str, Any]:
    """The same request on the wrapped engine's tokenizer manager, outside the language."""
    from engine.managers.tokenizer_manager import GenerateRequest

    async def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async for item in backend.engine.tokenizer_manager.generate(GenerateRequest(text=text, sampling_params=params)):
            out = item
        return out

    import asyncio

    return asyncio.run_coroutine_threadsafe(run(), backend.engine.loop).result()


def test_gen_and_chat_equal_the_engines_own_generate(engine_backend: Engine, tokenizer: Any) -> None:
    state = answer.run("The capital of France is", temperature=0, backend=engine_backend)
    by_hand = _by_hand(engine_backend, "The capital of France is", {"max_new_tokens": 12, "temperature": 0, "stop": "."})
    assert state["answer"] == by_hand["text"] and "." not in state["answer"]
    talk = chat.run("What is 2+2?", temperature=0, backend=engine_backend)
    prompt = tokenizer.apply_chat_template(talk.messages()[:2], tokenize=False, add_generation_prompt=True)
    assert talk["reply"] == _by_hand(engine_backend, prompt, {"max_new_tokens": 12, "temperature": 0})["text"]
    assert talk.text() == tokenizer.apply_chat_template(talk.messages(), tokenize=False)


@pytest.mark.parametrize("prog", [program, conversation], ids=["text", "chat"])
def test_the_same_program_gives_the_same_greedy_results_as_on_the_server(engine_backend: Engine, endpoint: Any,
                                                                       prog: Any) -> None:
    check_same_greedy_results(prog, engine_backend, endpoint)


def test_select_fork_and_batch(engine_backend: Engine) -> None:
    @function
    def program(s: Any, topic: str) -> None:
        s += f"Q: What color is {topic}?\nA: It is"
        s += select("color", choices=[" blue", " green", " red"])
        forks = s.fork(2)
        forks += gen("more", max_tokens=4)
        forks.join()

    states = program.run_batch([{"topic": "the sky"}, {"topic": "grass"}], temperature=0, backend=engine_backend)
    assert states[0]["color"] == " blue"
    for state in states:
        scores = state.get_meta_info("color")["scores"]
        assert state["color"] == [" blue", " green", " red"][scores.index(max(scores))]
        assert len(set(state["more"])) == 1  # greedy branches from one prefix agree
        assert all(m["cached_tokens"] > 0 for m in state.get_meta_info("more"))


def test_the_backend_imports_the_engine_only_when_created() -> None:
    import subprocess

    code = "import sys, engine_lang; engine_lang.Engine; print('engine' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_seed_patterns_run_unchanged(engine_backend: Engine) -> None:
    check_seed_patterns(engine_backend)
