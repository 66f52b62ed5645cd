"""The pooler against hand-computed vectors; pooling settings read from sentence-transformers' files."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from engine.errors import ConfigError
from engine.layers.pooler import Pooler, PoolState, pool
from engine.pooling import check_task, default_task, read_pooling_config, resolve_task

# Two rows packed back to back: row 0 has 3 tokens, row 1 has 2.
_HIDDEN = torch.tensor([[1.0, 2.0, 2.0], [3.0, 0.0, 4.0], [-1.0, 4.0, 0.0], [0.0, 3.0, 4.0], [2.0, -1.0, 0.0]])


@pytest.mark.parametrize("method,expected", [
    ("cls", [[1.0, 2.0, 2.0], [0.0, 3.0, 4.0]]),
    ("mean", [[1.0, 2.0, 2.0], [1.0, 1.0, 2.0]]),
    ("max", [[3.0, 4.0, 4.0], [2.0, 3.0, 4.0]]),
    ("last", [[-1.0, 4.0, 0.0], [2.0, -1.0, 0.0]]),
])
def test_methods_by_hand(method: str, expected: list[list[float]]) -> None:
    out = pool(_HIDDEN, [3, 2], method, normalize=False)
    assert [v.tolist() for v in out] == expected
    unit = pool(_HIDDEN, [3, 2], method, normalize=True)
    for v, e in zip(unit, expected):
        norm = math.sqrt(sum(x * x for x in e))
        assert v.tolist() == pytest.approx([x / norm for x in e])


def test_truncation_comes_before_normalisation() -> None:
    (v,) = pool(_HIDDEN[:1], [1], "cls", normalize=True, dimensions=[2])
    assert v.tolist() == pytest.approx([1 / math.sqrt(5), 2 / math.sqrt(5)])


@pytest.mark.parametrize("method", ["cls", "mean", "max", "last"])
def test_chunks_reduce_to_the_whole(method: str) -> None:
    pooler = Pooler(method, normalize=True)
    state = PoolState()
    for chunk in (_HIDDEN[:2], _HIDDEN[2:3], _HIDDEN[3:]):
        pooler.add(state, chunk)
    (whole,) = pool(_HIDDEN, [5], method, normalize=True)
    torch.testing.assert_close(pooler.finish([state], [None])[0], whole)


def test_head_runs_on_the_pooled_state() -> None:
    pooler = Pooler("last", normalize=False, head=lambda x: x.sum(dim=-1, keepdim=True))
    states = [PoolState(), PoolState()]
    pooler.add_batch(states, _HIDDEN, [3, 2])
    assert [v.tolist() for v in pooler.finish(states, [None, None])] == [[3.0], [1.0]]


def _st_dir(tmp_path: Any, pooling: dict[str, Any], modules: list[str], extra: dict[str, Any] | None = None) -> str:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    kinds = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"path": kinds[m], "type": f"sentence_transformers.models.{m}"} for m in modules]))
    if extra is not None:
        (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(extra))
    return str(tmp_path)


def test_sentence_transformers_files(tmp_path: Any) -> None:
    d = _st_dir(tmp_path, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
                ["Transformer", "Pooling", "Normalize"], {"truncate_dim": 128})
    cfg = read_pooling_config(d, "BertModel")
    assert (cfg.method, cfg.normalize, cfg.default_dimensions) == ("cls", True, 128)


def test_defaults_without_sentence_transformers_files(tmp_path: Any) -> None:
    assert read_pooling_config(str(tmp_path), "BertModel").method == "mean"
    assert read_pooling_config(str(tmp_path), "Qwen3ForCausalLM").method == "last"


@pytest.mark.parametrize("pooling,modules,match", [
    ({"pooling_mode_mean_sqrt_len_tokens": True}, ["Transformer", "Pooling"], "supported: exactly one"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, ["Transformer", "Pooling"], "exactly one"),
    ({"pooling_mode_lasttoken": True, "include_prompt": False}, ["Transformer", "Pooling"], "include_prompt"),
    ({"pooling_mode_mean_tokens": True}, ["Transformer", "Pooling", "Dense"], "Dense"),
])
def test_unsupported_sentence_transformers_files(tmp_path: Any, pooling: dict[str, Any], modules: list[str],
                                                 match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        read_pooling_config(_st_dir(tmp_path, pooling, modules), "BertModel")


def test_task_from_architecture() -> None:
    assert [default_task(a) for a in ("BertModel", "BertForMaskedLM", "Qwen2ForSequenceClassification",
                                      "LlamaForCausalLM")] == ["embed", "embed", "score", "generate"]
    assert resolve_task("embed", "Qwen3ForCausalLM") == "embed"
    with pytest.raises(ConfigError, match="--task generate: architecture BertModel"):
        resolve_task("generate", "BertModel")


def test_task_checks_at_start_up() -> None:
    from types import SimpleNamespace

    from engine.config import ServerArgs

    bert = SimpleNamespace(architectures=["BertModel"])
    assert check_task(ServerArgs(), bert) == "embed"
    with pytest.raises(ConfigError, match="--pp-size"):
        check_task(ServerArgs(pp_size=2), bert)
    with pytest.raises(ConfigError, match="--enable-matryoshka"):
        check_task(ServerArgs(enable_matryoshka=True), SimpleNamespace(architectures=["LlamaForCausalLM"]))
