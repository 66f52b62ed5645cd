"""The OpenAI-compatible backend pointed at ``engine serve``'s ``/v1``: the kit for it and for
``RuntimeEndpoint``, and the same programs on both with the same greedy results."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_lang import (
    OpenAI,
    ProgramError,
    RuntimeEndpoint,
    UnsupportedOperation,
    function,
    gen,
)
from engine_lang.testing import BackendConformance
from lang_programs import check_same_greedy_results, conversation, program


@pytest.fixture(scope="module")
def openai_backend(server: Any) -> Iterator[OpenAI]:
    with OpenAI("default", base_url=server.url + "/v1", api_key="none") as backend:
        yield backend


class TestOpenAIConformance(BackendConformance):
    # The OpenAI API has no prompt-only request, so fork sends no prefix hint.
    reports_cached_tokens = False

    @pytest.fixture(scope="class")
    def backend(self, openai_backend: OpenAI) -> OpenAI:
        return openai_backend


class TestRuntimeEndpointConformance(BackendConformance):
    @pytest.fixture(scope="class")
    def backend(self, endpoint: RuntimeEndpoint) -> RuntimeEndpoint:
        return endpoint


@pytest.mark.parametrize("prog", [program, conversation], ids=["text", "chat"])
def test_the_same_program_gives_the_same_greedy_results(openai_backend: OpenAI, endpoint: RuntimeEndpoint,
                                                        prog: Any) -> None:
    check_same_greedy_results(prog, openai_backend, endpoint)


def test_chat_messages_go_to_chat_completions(openai_backend: OpenAI, tokenizer: Any) -> None:
    # The server renders the messages with its template; the client renders s.text() with the
    # template /get_model_info reports, so both agree with transformers.
    state = conversation.run("Name a planet.", temperature=0, backend=openai_backend)
    assert state.text() == tokenizer.apply_chat_template(state.messages(), tokenize=False)


def test_unsupported_operation_names_it(openai_backend: OpenAI) -> None:
    @function
    def with_logprobs(s: Any) -> None:
        s += "Hello"
        s += gen("x", max_tokens=2, return_logprob=True)

    with pytest.raises(ProgramError, match="return_logprob") as info:
        with_logprobs.run(backend=openai_backend)
    assert isinstance(info.value.__cause__, UnsupportedOperation) and info.value.variable == "x"
