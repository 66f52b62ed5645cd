"""The conformance kit for frontend-language backends (pytest).

A backend's tests subclass ``BackendConformance`` and give a ``backend`` fixture; the flags say
which optional operations the backend has. Each test runs a small program on the backend; one
without an operation must raise ``UnsupportedOperation`` naming it::

    from engine_lang.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        supports_select = False

        @pytest.fixture(scope="class")
        def backend(self):
            with MyBackend(...) as backend:
                yield backend

The programs use a few tokens each and temperature 0, so any model that follows a prompt passes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from engine_lang.backends.base import Backend, UnsupportedOperation
from engine_lang.ir import assistant, gen, select, system, user
from engine_lang.program import function
from engine_lang.run_context import ProgramError

PROMPT = "The capital of France is"


@function
def _one_gen(s: Any, prompt: str, stop: str | None) -> None:
    s += prompt
    s += gen("answer", max_tokens=8, stop=stop)


@function
def _chat(s: Any) -> None:
    s += system("You are terse.")
    s += user("Name a color.")
    s += assistant(gen("answer", max_tokens=6))


@function
def _choose(s: Any) -> None:
    s += "Q: Is the sun hot? Answer yes or no.\nA:"
    s += select("answer", choices=[" yes", " no"])


@function
def _branches(s: Any) -> None:
    s += "A list of fruits, one per line, starting with apples and pears and plums:\n"
    forks = s.fork(2)
    forks += gen("item", max_tokens=4)
    forks.join()


class BackendConformance:
    """Subclass and provide a ``backend`` fixture; set the flags the backend needs."""

    #: gen(stream=True) through ``generate_stream``.
    supports_stream: ClassVar[bool] = True
    #: select(), scored from input logprobs.
    supports_select: ClassVar[bool] = True
    #: system()/user()/assistant() through the model's chat template.
    supports_chat: ClassVar[bool] = True
    #: meta_info["cached_tokens"] reflects the server's prefix cache (fork sends a prefix hint).
    reports_cached_tokens: ClassVar[bool] = True

    @pytest.fixture(scope="class")
    def backend(self) -> Backend:
        raise NotImplementedError("a BackendConformance subclass provides the backend fixture")

    def test_is_a_backend(self, backend: Backend) -> None:
        assert isinstance(backend, Backend) and backend.name

    def test_greedy_gen_is_deterministic_and_bounded(self, backend: Backend) -> None:
        first = _one_gen.run(PROMPT, None, temperature=0, backend=backend)
        second = _one_gen.run(PROMPT, None, temperature=0, backend=backend)
        assert first["answer"] == second["answer"] and first["answer"]
        assert first.text() == PROMPT + first["answer"]
        meta = first.get_meta_info("answer")
        assert meta["completion_tokens"] is None or 0 < meta["completion_tokens"] <= 8

    def test_stop_string_ends_and_is_trimmed(self, backend: Backend) -> None:
        free = _one_gen.run(PROMPT, None, temperature=0, backend=backend)["answer"]
        words = free.split()
        if len(words) < 2:
            pytest.skip(f"the model's answer {free!r} has no second word to stop at")
        stop = " " + words[1]
        stopped = _one_gen.run(PROMPT, stop, temperature=0, backend=backend)["answer"]
        assert stop not in stopped and free.startswith(stopped)

    def test_stream_yields_the_same_text(self, backend: Backend) -> None:
        if not self.supports_stream:
            with pytest.raises(ProgramError, match="stream"):
                _one_gen.run(PROMPT, None, temperature=0, stream=True, backend=backend).text()
            return
        state = _one_gen.run(PROMPT, None, temperature=0, stream=True, backend=backend)
        pieces = list(state.text_iter("answer"))
        plain = _one_gen.run(PROMPT, None, temperature=0, backend=backend)["answer"]
        assert "".join(pieces) == state["answer"] == plain

    def test_chat_roles(self, backend: Backend) -> None:
        if not self.supports_chat:
            with pytest.raises(ProgramError, match="chat roles"):
                _chat.run(temperature=0, backend=backend).text()
            return
        state = _chat.run(temperature=0, backend=backend)
        messages = state.messages()
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        assert messages[2]["content"] == state["answer"]
        template = backend.chat_template()
        assert state.text() == template.render(messages)

    def test_select(self, backend: Backend) -> None:
        if not self.supports_select:
            with pytest.raises(ProgramError, match="select") as info:
                _choose.run(backend=backend).text()
            assert isinstance(info.value.__cause__, UnsupportedOperation)
            return
        state = _choose.run(backend=backend)
        meta = state.get_meta_info("answer")
        assert state["answer"] in (" yes", " no")
        assert len(meta["scores"]) == 2 and state["answer"] == [" yes", " no"][meta["scores"].index(max(meta["scores"]))]

    def test_fork_branches(self, backend: Backend) -> None:
        state = _branches.run(temperature=0, backend=backend)
        items = state["item"]
        assert len(items) == 2 and items[0] == items[1]  # same prefix, greedy: same text
        if self.reports_cached_tokens:
            assert all(m["cached_tokens"] > 0 for m in state.get_meta_info("item")), state.get_meta_info("item")

    def test_abort_of_a_finished_request_is_harmless(self, backend: Backend) -> None:
        backend.abort("engine-lang-no-such-request")
