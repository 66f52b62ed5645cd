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


class _Flow(_Manager):
    """A manager whose scheduler answers every request with [first token id, length] (or an error
    for token id 0), through ``_handle_embedding_out`` as the receive loop would."""

    def __init__(self) -> None:
        from engine.router.router import Router

        super().__init__()
        self.states: dict[str, Any] = {}
        self.router = Router(1)
        self.sends = [SimpleNamespace(send_pyobj=self._scheduler)]
        self.on_route: list[Any] = []
        self.on_finish: list[Any] = []
        self.dead = None
        self.aborted: list[str] = []

    def start(self) -> None:
        pass

    def add_group(self, rid: str, rids: list[str]) -> None:
        pass

    def _leave_groups(self, rid: str) -> None:
        pass

    def _send_for(self, rid: str, msg: Any) -> None:
        self.aborted.append(rid)

    def _scheduler(self, msg: Any) -> None:
        from engine.managers.io_struct import BatchEmbeddingOut

        ids = msg.input_ids
        error = {"type": "abort", "message": "token 0 refused"} if ids[0] == 0 else None
        out = BatchEmbeddingOut(rids=[msg.rid], embeddings=[None if error else [float(ids[0]), float(len(ids))]],
                                errors=[error], prompt_tokens=[len(ids)], cached_tokens=[0])
        asyncio.get_running_loop().call_soon(self._handle_embedding_out, out)


def test_vectors_come_back_in_input_order_and_are_observed() -> None:
    manager = _Flow()
    finished: list[Any] = []
    manager.on_finish.append(finished.append)
    out = asyncio.run(manager.embed(EmbeddingRequest(inputs=[[7, 8, 9], [5]], rid="batch")))
    assert [(r.index, r.embedding, r.prompt_tokens) for r in out] == [(0, [7.0, 3.0], 3), (1, [5.0, 1.0], 1)]
    assert sorted(s.rid for s in finished) == ["batch-0", "batch-1"] and not manager.states
    assert all(s.meta["completion_tokens"] == 0 and s.last_time is not None for s in finished)


def test_a_refused_input_fails_the_request_naming_input() -> None:
    manager = _Flow()
    with pytest.raises(RequestError, match="token 0 refused") as info:
        asyncio.run(manager.embed(EmbeddingRequest(inputs=[[7], [0, 1]])))
    assert info.value.field == "input" and not manager.states
