"""``encode_json`` (the streamed events' encoder) gives ``json.dumps``'s text for compact, non-ASCII JSON,
also where it falls back to the plain encoder."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from engine.entrypoints.http import jsonenc
from engine.entrypoints.http.jsonenc import encode_json

CASES: list[Any] = [
    "plain", "ünï\u2028\"\\\n\x00", 1, -0.0, 1.5e-300, 0.1 + 0.2, float("nan"), float("inf"), None, True, [], {},
    [1, "a", None, [2.5, {"k": "v"}]], (1, 2), 10**30,
    {"id": "x", "n": 3, "none": None, "b": False, "nested": {"l": [1, 2], "s": "é"}},
    {1: "int key", 2.5: "float key", None: "null key", False: "bool key"},
]


@pytest.mark.parametrize("value", CASES, ids=range(len(CASES)))
def test_same_text_as_json_dumps(value: Any) -> None:
    assert encode_json(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def test_unencodable_value_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        encode_json({"x": object()})


def test_without_the_c_accelerator_the_plain_encoder_is_used_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    with caplog.at_level(logging.WARNING, logger=jsonenc.__name__):
        plain = jsonenc._make_encoder()
    assert "c_make_encoder is missing" in caplog.text
    for value in CASES:
        assert plain(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
