"""``TokenizerManager.embed``'s checks, before anything is sent to the scheduler."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from engine.managers.request_state import RequestError
from engine.managers.tokenizer_embed import EmbeddingRequest, EmbedMixin


class _Manager(EmbedMixin):
    def __init__(self, task: str = "embed", **pooling: Any) -> None:
        self.ready = SimpleNamespace(task=task, embedding_size=384, context_len=8, vocab_size=100,
                                     pooling={"matryoshka": False, **pooling})
        self.tokenizer = None
        self.sent: list[Any] = []

    def _check_alive(self) -> None:
        pass

    def refuses_new(self) -> bool:
        return False

    def start(self) -> None:
        raise AssertionError("a refused request must not reach the scheduler")


def _refused(manager: _Manager, req: EmbeddingRequest) -> RequestError:
    with pytest.raises(RequestError) as info:
        asyncio.run(manager.embed(req))
    return info.value


def test_dimensions_need_matryoshka_or_the_flag() -> None:
    error = _refused(_Manager(), EmbeddingRequest(inputs=[[1]], dimensions=64))
    assert error.field == "dimensions" and "--enable-matryoshka" in str(error)
    sizes = _Manager(matryoshka=True, matryoshka_dimensions=[64, 128])
    assert sizes._check_dimensions(64) == 64
    assert "accepted for this model: 64, 128" in str(_refused(sizes, EmbeddingRequest(inputs=[[1]], dimensions=100)))
    assert _Manager(matryoshka=True)._check_dimensions(100) == 100
    assert _Manager(default_dimensions=128)._check_dimensions(None) == 128
    assert "from 1 to 384" in str(_refused(_Manager(matryoshka=True), EmbeddingRequest(inputs=[[1]], dimensions=0)))
    assert "scoring model" in str(_refused(_Manager("score", matryoshka=True), EmbeddingRequest(inputs=[[1]],
                                                                                                 dimensions=8)))


@pytest.mark.parametrize("inputs,words", [
    ([], "the list of inputs is empty"),
    ([[1], []], "input[1]: the list of token ids is empty"),
    ([[1, 100]], "token id 100 is outside the vocabulary (0..99)"),
    ([list(range(9))], "the input has 9 tokens; this model's context length is 8"),
    (["text"], "--skip-tokenizer-init"),
    ([3.5], "invalid value of type float"),
])
def test_inputs(inputs: list[Any], words: str) -> None:
    error = _refused(_Manager(), EmbeddingRequest(inputs=inputs))
    assert error.field == "input" and words in str(error)


def test_a_generation_server_refuses() -> None:
    error = _refused(_Manager("generate"), EmbeddingRequest(inputs=[[1]]))
    assert error.field == "model" and "--task embed" in str(error)
    with pytest.raises(RequestError, match="--task generate"):
        _Manager("embed").check_generation_task("/generate")
