"""Programs the backend tests share: the seed documents' frontend examples, verbatim apart from
the import line, and a backend mixin that records each generation's request and timing."""

from __future__ import annotations

import time
from typing import Any

from engine_lang import *  # noqa: F403 - the seed's examples use the bare names
from engine_lang import assistant, function, gen, select, user
from engine_lang.backends.base import GenOutput, GenRequest


class Recording:
    """Mixed into a backend class: keeps (request, start, end) of every ``generate``."""

    calls: list[tuple[GenRequest, float, float]]

    def generate(self, req: GenRequest) -> GenOutput:
        start = time.monotonic()
        out = super().generate(req)  # type: ignore[misc]
        self.calls.append((req, start, time.monotonic()))
        return out


# -- the seed documents' patterns (seed 000, section 8.4), unchanged --------------------------------
@function
def simple_gen(s, prompt):  # noqa: ANN001, ANN201
    s += prompt
    s += gen("response", max_tokens=100)  # noqa: F405


@function
def chat_dialogue(s, user_input):  # noqa: ANN001, ANN201
    s += system("You are a helpful assistant.")  # noqa: F405
    s += user(user_input)  # noqa: F405
    s += assistant(gen(max_tokens=128))  # noqa: F405


@function
def conditional_gen(s, question):  # noqa: ANN001, ANN201
    s += f"Question: {question}\nAnswer:"
    first_word = gen(max_tokens=1, choices=["Yes", "No"])  # noqa: F405
    if first_word == "Yes":
        s += gen(max_tokens=50)  # noqa: F405
    else:
        s += gen(max_tokens=20)  # noqa: F405


# -- programs run on several backends, whose greedy results must agree --------------------------------
QUESTION = "What is the capital of France?"


@function
def program(s: Any, question: str) -> None:
    s += "Question: " + question + "\nAnswer:"
    s += gen("plain", max_tokens=8, stop="\n")
    s += "\nIs that right? Answer:"
    s += select("check", choices=[" yes, it is", " no, it is not"])
    forks = s.fork(2)
    forks += gen("branch", max_tokens=4)
    forks.join()


@function
def conversation(s: Any, question: str) -> None:
    s += user(question)
    s += assistant(gen("reply", max_tokens=10))
    with s.user():
        s += "And in one word?"
    s += assistant(gen("word", max_tokens=4))


def check_same_greedy_results(prog: Any, backend: Any, reference: Any) -> None:
    """``prog`` (``program`` or ``conversation``) at temperature 0 gives on ``backend`` what it gives
    on ``reference``: text, messages, variables and (up to float noise) the choice scores."""
    import pytest

    ours = prog.run(QUESTION, temperature=0, backend=backend)
    theirs = prog.run(QUESTION, temperature=0, backend=reference)
    assert ours.text() == theirs.text()
    assert ours.messages() == theirs.messages()
    if prog is program:
        assert ours["plain"] == theirs["plain"] and ours["branch"] == theirs["branch"]
        assert ours["check"] == theirs["check"]
        assert ours.get_meta_info("check")["scores"] == pytest.approx(theirs.get_meta_info("check")["scores"], abs=2e-2)


def check_seed_patterns(backend: Any) -> None:
    """Runs the three patterns on ``backend`` (a Recording one) and checks what each means."""
    set_default_backend(backend)  # noqa: F405
    one = simple_gen.run(prompt="The capital of France is", temperature=0)
    two = chat_dialogue.run(user_input="What is the capital of France?", temperature=0)
    assert one["response"] and one.text().startswith("The capital of France is")
    assert two.messages()[-1]["role"] == "assistant" and two.messages()[-1]["content"]
    backend.calls.clear()
    three = conditional_gen.run(question="Is Paris the capital of France?", temperature=0)
    head = "Question: Is Paris the capital of France?\nAnswer:"

    @function
    def first_word(s: Any) -> None:
        s += head
        s += select("word", choices=["Yes", "No"])

    word = first_word.run()["word"]
    # The compared gen was evaluated on the text so far and not appended; the branch it chose
    # generated right after "Answer:" with its own max_tokens.
    (req, _, _), = backend.calls
    assert req.text == head and req.sampling_params["max_new_tokens"] == (50 if word == "Yes" else 20)
    assert three.text().startswith(head) and len(three.text()) > len(head)
