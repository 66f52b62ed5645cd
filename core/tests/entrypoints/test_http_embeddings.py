"""/v1/embeddings and /encode in-process over a fake tokenizer manager: the request shapes reach
``TokenizerManager.embed`` as inputs, the answer's shape, base64, and 400s naming the field."""

from __future__ import annotations

import base64
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.entrypoints.http.embeddings import router
from engine.entrypoints.http.errors import APIError, install_error_handlers
from engine.managers.tokenizer_embed import EmbeddingRequest, EmbeddingResult


class FakeManager:
    """Answers each input with [len(input), index + 0.5] and records the requests."""

    def __init__(self) -> None:
        self.requests: list[EmbeddingRequest] = []

    async def embed(self, req: EmbeddingRequest) -> list[EmbeddingResult]:
        self.requests.append(req)
        return [EmbeddingResult(i, [float(len(x)), i + 0.5], len(x)) for i, x in enumerate(req.inputs)]


@pytest.fixture()
def client() -> tuple[TestClient, FakeManager]:
    manager = FakeManager()

    def check_model(name: str | None) -> None:
        if name not in (None, "default"):
            raise APIError(404, f"model '{name}' does not exist", param="model")

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    app.state.ctx = SimpleNamespace(manager=manager, model_name="default", check_model=check_model,
                                    check_accepting=lambda: None)
    return TestClient(app), manager


@pytest.mark.parametrize("value,inputs", [
    ("hi", ["hi"]),
    (["a", "bcd"], ["a", "bcd"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5], [6, 7]], [[5], [6, 7]]),
    (["text", [8, 9]], ["text", [8, 9]]),
])
def test_input_shapes(client: tuple[TestClient, FakeManager], value: Any, inputs: list[Any]) -> None:
    http, manager = client
    r = http.post("/v1/embeddings", json={"model": "default", "input": value, "encoding_format": None})
    assert r.status_code == 200, r.text
    assert manager.requests[-1].inputs == inputs
    body = r.json()
    assert body["object"] == "list" and body["model"] == "default"
    assert [d["embedding"][0] for d in body["data"]] == [float(len(x)) for x in inputs]
    total = sum(len(x) for x in inputs)
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}


def test_base64_and_dimensions(client: tuple[TestClient, FakeManager]) -> None:
    http, manager = client
    r = http.post("/v1/embeddings", json={"input": ["ab", "c"], "encoding_format": "base64", "dimensions": 2})
    assert manager.requests[-1].dimensions == 2
    packed = [d["embedding"] for d in r.json()["data"]]
    assert [list(struct.unpack("<2f", base64.b64decode(p))) for p in packed] == [[2.0, 0.5], [1.0, 1.5]]


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", 3]}, "input"),
    ({"input": [[1, "x"]]}, "input"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "model": "gpt-4"}, "model"),
])
def test_bad_requests(client: tuple[TestClient, FakeManager], body: dict[str, Any], param: str) -> None:
    http, manager = client
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert not manager.requests


def test_native_encode(client: tuple[TestClient, FakeManager]) -> None:
    http, manager = client
    one = http.post("/encode", json={"text": "abc", "rid": "r1"}).json()
    assert one["embedding"] == [3.0, 0.5] and one["meta_info"]["prompt_tokens"] == 3
    assert manager.requests[-1].rid == "r1" and manager.requests[-1].field_name == "text"
    many = http.post("/encode", json={"input_ids": [[1, 2], [3]]}).json()
    assert [m["embedding"][0] for m in many] == [2.0, 1.0]
    r = http.post("/encode", json={"text": "a", "input_ids": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"
