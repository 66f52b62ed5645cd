"""Fixtures of the frontend-language tests: the session's shared default-model server (started on
first use), the default model's transformers tokenizer, and a backend that records its requests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_lang import RuntimeEndpoint  # noqa: E402
from lang_programs import Recording  # noqa: E402
from test_server_e2e_harness import Server, shared_default_server  # noqa: E402


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """``engine serve`` on the embedded default model, as the docs start it (the session's shared one)."""
    return shared_default_server(request.config, tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from engine.model_executor.checkpoint import resolve_checkpoint

    return AutoTokenizer.from_pretrained(resolve_checkpoint(None))


class RecordingEndpoint(Recording, RuntimeEndpoint):
    """A RuntimeEndpoint that keeps each generation's request and its start and end times."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = []


@pytest.fixture(scope="module")
def endpoint(server: Server) -> Iterator[RecordingEndpoint]:
    with RecordingEndpoint(server.url) as backend:
        yield backend
