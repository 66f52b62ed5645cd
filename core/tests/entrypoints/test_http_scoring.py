"""The scoring routes' parts that need no engine: what a scoring model's logits mean (labels,
activation, probabilities), the task checks and the pair encoding."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import pytest

from engine.entrypoints.http.errors import APIError
from engine.entrypoints.http.scoring import _encode_pairs, _require_scoring
from engine.entrypoints.http.scoring_heads import ScoreHead, read_score_head


def _write_config(tmp_path: Any, **values: Any) -> str:
    (tmp_path / "config.json").write_text(json.dumps(values))
    return str(tmp_path)


def test_labels_come_from_id2label(tmp_path: Any) -> None:
    path = _write_config(tmp_path, id2label={"0": "negative", "1": "positive"})
    head = read_score_head(path, 2)
    assert head.labels == ("negative", "positive")
    assert head.activation.endswith("Sigmoid")
    # transformers' names where the config has none.
    assert read_score_head(_write_config(tmp_path), 3).labels == ("LABEL_0", "LABEL_1", "LABEL_2")


@pytest.mark.parametrize(("config", "logit", "expected"), [
    ({}, 2.0, 1 / (1 + math.exp(-2.0))),  # CrossEncoder's default for one label
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, 2.5, 2.5),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, 0.5, math.tanh(0.5)),
    ({}, -800.0, 0.0),  # no overflow far from zero
])
def test_score_activation_follows_sentence_transformers(tmp_path: Any, config: dict[str, Any], logit: float,
                                                        expected: float) -> None:
    head = read_score_head(_write_config(tmp_path, **config), 1)
    assert head.activate(logit) == pytest.approx(expected, abs=1e-12)


def test_unknown_activation_is_named(tmp_path: Any) -> None:
    head = read_score_head(_write_config(tmp_path, sentence_transformers={"activation_fn": "my.Swish"}), 1)
    with pytest.raises(APIError, match="my.Swish.*supported: Sigmoid, Identity, Tanh"):
        head.activate(1.0)


def test_probabilities() -> None:
    head = ScoreHead(3, ("a", "b", "c"), "Sigmoid")
    probs = head.probabilities([1.0, 2.0, 3.0])
    exps = [math.exp(x) for x in (1.0, 2.0, 3.0)]
    assert probs == pytest.approx([e / sum(exps) for e in exps])
    assert head.probabilities([1000.0, 0.0, -1000.0]) == pytest.approx([1.0, 0.0, 0.0])
    assert ScoreHead(1, ("r",), "Sigmoid").probabilities([0.0]) == [0.5]


def test_a_generation_server_refuses_scoring() -> None:
    ctx = SimpleNamespace(manager=SimpleNamespace(task="generate"))
    with pytest.raises(APIError) as info:
        _require_scoring(ctx, "/v1/rerank")  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == "model"
    assert "--task score" in info.value.message and "--task generate" in info.value.message
    for task in ("score", "embed"):
        assert _require_scoring(SimpleNamespace(manager=SimpleNamespace(task=task)), "/v1/score") == task  # type: ignore[arg-type]


def test_pairs_keep_segment_ids_where_the_tokenizer_makes_them(tmp_path: Any) -> None:
    import transformers

    from engine.testing.checkpoints import copy_tokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "paris", "city", "what"]
    bert = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    assert _encode_pairs(bert, ["what city"], ["paris"]) == [([2, 7, 6, 3, 5, 3], [0, 0, 0, 0, 1, 1])]
    # A byte-level BPE (decoder models) makes no segment ids: the pair is its two texts' tokens.
    copy_tokenizer(str(tmp_path))
    bpe = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids, types = _encode_pairs(bpe, ["ab"], ["cd"])[0]
    assert types is None and ids == bpe("ab", "cd")["input_ids"]
