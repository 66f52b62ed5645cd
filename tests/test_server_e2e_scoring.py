"""End to end: ``engine serve`` on a tiny random BERT cross-encoder (``--task score``):
``/v1/rerank``, ``/v1/score`` and ``/classify`` equal transformers' logits through the activation."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import MODEL_NAME, Server, launch, running  # noqa: E402

# float32 on the CPU, through other kernels than transformers': summation order only.
ATOL = 1e-4
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital city of France.", "The river is deep.", "Python is a language.",
             "Deep neural networks learn.", "France is in the city of capital Paris?"]
_WORDS = ("the a is of and to in what capital france paris city river sea deep learning neural networks python "
          "language learn").split()


def _bert_tokenizer(directory: str) -> Any:
    """A WordPiece tokenizer of 90 tokens (letters, pieces and a few words), saved into ``directory``."""
    import transformers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789.,?!'",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"), *_WORDS]
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    tokenizer.save_pretrained(directory)
    return tokenizer


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any]:
    """The checkpoint, transformers' model of it and its tokenizer."""
    from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("cross-encoder"))
    make_tiny_checkpoint(path, "BertForSequenceClassification", num_labels=1, vocab_size=96, hidden_size=32,
                         intermediate_size=64, num_attention_heads=4, max_position_embeddings=128,
                         id2label={0: "relevant"}, label2id={"relevant": 0})
    tokenizer = _bert_tokenizer(path)  # replaces the byte-level BPE the helper copies
    model = load_hf_model(path, reference="BertForSequenceClassification")
    # Random weights score every pair alike; a larger classifier, centred on the test's pairs,
    # spreads their scores over (0, 1).
    with torch.no_grad():
        model.classifier.weight.mul_(300.0)
        logits = model(**tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, return_tensors="pt")).logits
        model.classifier.bias.sub_(logits.mean())
    model.save_pretrained(path)
    return path, model, tokenizer


@pytest.fixture(scope="module")
def server(reference: tuple[str, Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch(reference[0], str(tmp_path_factory.mktemp("scoring-logs")))
    with running(srv):
        yield srv


def _logit(reference: tuple[str, Any, Any], *texts: str) -> float:
    import torch

    _, model, tokenizer = reference
    with torch.no_grad():
        return float(model(**tokenizer(*texts, return_tensors="pt")).logits[0, 0])


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _pair_tokens(reference: tuple[str, Any, Any], a: str, b: str) -> int:
    return len(reference[2](a, b)["input_ids"])


def test_rerank_orders_documents_by_the_cross_encoder(server: Server, reference: tuple[str, Any, Any]) -> None:
    from sentence_transformers import CrossEncoder

    # sentence-transformers' CrossEncoder on the same directory is the oracle of relevance scores.
    expected = [float(s) for s in CrossEncoder(reference[0], device="cpu").predict([(QUERY, d) for d in DOCUMENTS])]
    assert max(expected) - min(expected) > 0.1  # far apart: the order is the model's, not rounding's
    r = server.post("/v1/rerank", json={"model": MODEL_NAME, "query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for x in results:
        assert abs(x["relevance_score"] - expected[x["index"]]) <= ATOL, (x, expected)
        assert x["document"] == {"text": DOCUMENTS[x["index"]]}
    tokens = sum(_pair_tokens(reference, QUERY, d) for d in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert body["model"] == MODEL_NAME and body["id"].startswith("rerank-")


def test_rerank_top_n_without_documents(server: Server) -> None:
    full = server.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()["results"]
    objects = [{"text": d} for d in DOCUMENTS]
    r = server.post("/v1/rerank", json={"query": QUERY, "documents": objects, "top_n": 2, "return_documents": False})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    # The same order and scores (up to how the rows were batched), without the texts.
    assert [x["index"] for x in results] == [x["index"] for x in full[:2]]
    for got, want in zip(results, full[:2], strict=True):
        assert set(got) == {"index", "relevance_score"} and abs(got["relevance_score"] - want["relevance_score"]) <= ATOL


def test_score_one_to_many_and_pairwise(server: Server, reference: tuple[str, Any, Any]) -> None:
    r = server.post("/v1/score", json={"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCUMENTS[:3]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2] and all(d["object"] == "score" for d in data)
    for d, doc in zip(data, DOCUMENTS[:3], strict=True):
        assert abs(d["score"] - _sigmoid(_logit(reference, QUERY, doc))) <= ATOL
    firsts = ["Deep learning", "the sea"]
    r = server.post("/score", json={"text_1": firsts, "text_2": DOCUMENTS[3:5]})
    assert r.status_code == 200, r.text
    for d, a, b in zip(r.json()["data"], firsts, DOCUMENTS[3:5], strict=True):
        assert abs(d["score"] - _sigmoid(_logit(reference, a, b))) <= ATOL


def test_classify_labels_from_the_config(server: Server, reference: tuple[str, Any, Any]) -> None:
    texts = ["Paris is a city.", "what?"]
    r = server.post("/classify", json={"model": MODEL_NAME, "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    for i, (item, text) in enumerate(zip(body["data"], texts, strict=True)):
        logit = _logit(reference, text)
        assert item["index"] == i and item["label"] == "relevant" and item["num_classes"] == 1
        assert abs(item["logits"][0] - logit) <= ATOL
        assert abs(item["probs"][0] - _sigmoid(logit)) <= ATOL
    one = server.post("/v1/classify", json={"input": texts[0]}).json()["data"]
    assert len(one) == 1 and abs(one[0]["probs"][0] - body["data"][0]["probs"][0]) <= ATOL


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": DOCUMENTS}, "query"),
    ("/v1/rerank", {"documents": DOCUMENTS}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": ["ok", ""]}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": ["paris", "paris " * 200]}, "documents"),  # past 128 positions
    ("/v1/rerank", {"query": QUERY, "documents": [7]}, "documents[0]"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_k": 2}, "top_k"),
    ("/v1/rerank", {"model": "other", "query": QUERY, "documents": DOCUMENTS}, "model"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/classify", {"input": []}, "input"),
    ("/classify", {"input": [[1, 2], [99999]]}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(server: Server, path: str, body: dict[str, Any], param: str) -> None:
    r = server.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert param.split("[")[0] in error["message"], error
