"""``TokenizerManager.tokenize``'s checks of a prompt given as token ids."""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

import pytest

from engine.managers.request_state import RequestError
from engine.managers.tokenizer_manager import GenerateRequest, TokenizerManager


class _Id(enum.IntEnum):
    FIVE = 5


def _manager() -> TokenizerManager:
    manager = TokenizerManager.__new__(TokenizerManager)  # no sockets: tokenize reads only ``ready``
    manager.ready = SimpleNamespace(vocab_size=100)
    return manager


def test_ids_are_copied() -> None:
    ids = [0, 7, 99]
    out = _manager().tokenize(GenerateRequest(input_ids=ids))
    assert out == ids and out is not ids
    assert _manager().tokenize(GenerateRequest(input_ids=[_Id.FIVE, 1])) == [5, 1]  # an int subclass is an int


@pytest.mark.parametrize("ids,words", [
    ([1, True], "expected a list of integers"),
    ([1, 2.0], "expected a list of integers"),
    ([1, "2"], "expected a list of integers"),
    ((1, 2), "expected a list of integers"),
    ([5, 100, -1], "token id 100 is outside the vocabulary (0..99)"),
    ([5, -1, 100], "token id -1 is outside the vocabulary (0..99)"),
])
def test_bad_ids(ids: Any, words: str) -> None:
    with pytest.raises(RequestError) as info:
        _manager().tokenize(GenerateRequest(input_ids=ids))
    assert info.value.field == "input_ids" and words in str(info.value)
