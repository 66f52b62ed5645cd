"""End to end: ``engine serve --task embed`` on the embedded all-MiniLM-L6-v2, driven by the
``openai`` client and langchain's ``OpenAIEmbeddings``, against sentence-transformers on the same
model directory (the oracle). Where plugserve-grpc is installed the server serves gRPC too, and
its ``Embed`` must equal ``/v1/embeddings``."""

from __future__ import annotations

import base64
import importlib.util
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import API_KEY, Server, free_port, running, shared_default_server  # noqa: E402

MAX_COSINE_DISTANCE = 1e-5
SENTENCES = ["Hi.", "The cat sat on the mat.",
             "Retrieval-augmented generation looks up passages that are close to the question in an embedding "
             "space and hands them to the model together with the question, so the answer can cite them.",
             "Paris is the capital of France; Berlin is the capital of Germany; Madrid is the capital of Spain."]


@pytest.fixture(scope="module")
def model_dir() -> str:
    from engine.default_model.embedding import embedding_model_dir

    return embedding_model_dir()


@pytest.fixture(scope="module")
def oracle(model_dir: str) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_dir, device="cpu")


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("embed-logs") / "server.log")
    grpc = ("--grpc-port", str(free_port())) if importlib.util.find_spec("engine_grpc") else ()
    cmd = [sys.executable, "-m", "engine", "serve", "--task", "embed", "--enable-matryoshka", "--host", "127.0.0.1",
           "--port", str(port), "--api-key", API_KEY, *grpc]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    srv = Server(proc, port, log_path)
    if grpc:
        srv.extra["grpc_port"] = int(grpc[1])
    with running(srv):
        yield srv


def _cosine_distance(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(1.0 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _client(server: Server) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_client_equals_sentence_transformers(server: Server, oracle: Any, encoding_format: str) -> None:
    # The openai client asks for base64 when no format is given and decodes it; "float" is the JSON list.
    kwargs = {"encoding_format": encoding_format} if encoding_format == "float" else {}
    result = _client(server).embeddings.create(model="default", input=SENTENCES, **kwargs)
    expected = oracle.encode(SENTENCES)
    assert [d.index for d in result.data] == list(range(len(SENTENCES)))
    for got, want in zip(result.data, expected):
        assert len(got.embedding) == 384
        assert _cosine_distance(got.embedding, want) < MAX_COSINE_DISTANCE
        assert np.linalg.norm(got.embedding) == pytest.approx(1.0, abs=1e-5)
    tokens = sum(len(oracle.tokenizer(s)["input_ids"]) for s in SENTENCES)
    assert (result.usage.prompt_tokens, result.usage.total_tokens) == (tokens, tokens)


def test_base64_is_the_float_vector(server: Server) -> None:
    body = {"model": "default", "input": SENTENCES[1]}
    floats = server.post("/v1/embeddings", json={**body, "encoding_format": "float"}).json()["data"][0]["embedding"]
    packed = server.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist() == floats


def test_dimensions_truncate_then_normalise(server: Server, oracle: Any) -> None:
    result = _client(server).embeddings.create(model="default", input=SENTENCES[2], dimensions=64)
    want = oracle.encode(SENTENCES[2])[:64]
    assert len(result.data[0].embedding) == 64
    assert _cosine_distance(result.data[0].embedding, want) < MAX_COSINE_DISTANCE
    assert np.linalg.norm(result.data[0].embedding) == pytest.approx(1.0, abs=1e-5)


def test_token_id_inputs_equal_text_inputs(server: Server, oracle: Any) -> None:
    ids = [oracle.tokenizer(s)["input_ids"] for s in SENTENCES[:2]]
    by_ids = _client(server).embeddings.create(model="default", input=ids, encoding_format="float")
    one = _client(server).embeddings.create(model="default", input=ids[1], encoding_format="float")
    expected = oracle.encode(SENTENCES[:2])
    for got, want in zip(by_ids.data, expected):
        assert _cosine_distance(got.embedding, want) < MAX_COSINE_DISTANCE
    assert _cosine_distance(one.data[0].embedding, expected[1]) < MAX_COSINE_DISTANCE


def test_langchain_openai_embeddings(server: Server, oracle: Any) -> None:
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model="default", base_url=server.url + "/v1", api_key=API_KEY,
                                  check_embedding_ctx_length=False)
    docs = embeddings.embed_documents(SENTENCES)
    query = embeddings.embed_query("Which city is the capital of France?")
    for got, want in zip(docs, oracle.encode(SENTENCES)):
        assert _cosine_distance(got, want) < MAX_COSINE_DISTANCE
    assert _cosine_distance(query, oracle.encode("Which city is the capital of France?")) < MAX_COSINE_DISTANCE


def test_native_encode(server: Server, oracle: Any) -> None:
    r = server.post("/encode", json={"text": SENTENCES[1]})
    assert r.status_code == 200, r.text
    # Finished embedding requests are counted like any other (Prometheus /metrics).
    metrics = server.get("/metrics").text
    assert 'engine_requests_total{finish_reason="length",model_name="default"}' in metrics, metrics[-2000:]
    assert _cosine_distance(r.json()["embedding"], oracle.encode(SENTENCES[1])) < MAX_COSINE_DISTANCE
    assert r.json()["meta_info"]["prompt_tokens"] == len(oracle.tokenizer(SENTENCES[1])["input_ids"])


@pytest.mark.parametrize("body,param,words", [
    ({"input": []}, "input", "the list is empty"),
    ({"input": ["fine", ""]}, "input", "input[1]: the text is empty"),
    ({"input": {"text": "hi"}}, "input", "accepted: a string"),
    ({"input": " ".join(["word"] * 600)}, "input", "context length is 512"),
    ({"input": [[101, 99999, 102]]}, "input", "outside the vocabulary"),
    ({"input": "hi", "dimensions": 385}, "dimensions", "from 1 to 384"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format", "accepted: float, base64"),
    ({"input": "hi", "truncate": True}, "truncate", "truncate"),
])
def test_bad_inputs_are_400s_naming_the_field(server: Server, body: dict[str, Any], param: str, words: str) -> None:
    r = server.post("/v1/embeddings", json={"model": "default", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_generation_routes_are_400s_on_an_embedding_server(server: Server) -> None:
    info = server.get("/get_model_info").json()
    assert (info["is_generation"], info["task"]) == (False, "embed")
    r = server.post("/v1/completions", json={"model": "default", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    r = server.post("/v1/chat/completions", json={"model": "default", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"], r.text
    r = server.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"], r.text


def test_embeddings_are_a_400_on_a_generation_server(request: pytest.FixtureRequest,
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    # The session's shared server on the embedded chat model (other modules start it anyway).
    chat = shared_default_server(request.config, tmp_path_factory)
    r = chat.post("/v1/embeddings", json={"model": "default", "input": "Hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "--task embed" in r.json()["error"]["message"]


def test_rerank_and_score_by_cosine_similarity(server: Server, oracle: Any) -> None:
    """On an embedding model, /v1/rerank and /v1/score score a pair by the cosine similarity of its
    texts' vectors (vLLM's fallback for embedding models); /classify needs a classifier."""
    query = "What is the capital of Germany?"
    vectors = oracle.encode([query, *SENTENCES])
    expected = [float(vectors[0] @ v / (np.linalg.norm(vectors[0]) * np.linalg.norm(v))) for v in vectors[1:]]
    r = server.post("/v1/rerank", json={"model": "default", "query": query, "documents": SENTENCES, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(SENTENCES)), key=lambda i: -expected[i])[:3]
    assert results[0]["index"] == 3  # the passage about capitals
    for x in results:
        assert abs(x["relevance_score"] - expected[x["index"]]) < MAX_COSINE_DISTANCE
        assert x["document"] == {"text": SENTENCES[x["index"]]}
    r = server.post("/v1/score", json={"model": "default", "text_1": query, "text_2": SENTENCES[2:]})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(expected[2:], abs=MAX_COSINE_DISTANCE)
    r = server.post("/classify", json={"model": "default", "input": query})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "--task score" in r.text, r.text


def test_grpc_embed_equals_v1_embeddings(server: Server) -> None:
    pytest.importorskip("engine_grpc", reason="plugserve-grpc is not installed")
    import grpc
    from engine_grpc import plugserve_pb2 as pb
    from engine_grpc.client import Client

    texts = ["a short one", "a rather longer sentence to embed, with more tokens in it", "mid length text"]
    with Client(f"127.0.0.1:{server.extra['grpc_port']}", api_key=API_KEY, timeout=60) as client:
        reply = client.stub.Embed(pb.EmbedRequest(texts=texts), metadata=client.metadata)
        http = server.post("/v1/embeddings", json={"input": texts}).json()
        assert [e.index for e in reply.embeddings] == [0, 1, 2]
        assert reply.prompt_tokens == http["usage"]["prompt_tokens"]
        for ours, theirs in zip(reply.embeddings, http["data"], strict=True):
            assert len(ours.values) == len(theirs["embedding"])
            assert max(abs(a - b) for a, b in zip(ours.values, theirs["embedding"], strict=True)) < 1e-5
            assert math.isclose(sum(v * v for v in ours.values), 1.0, rel_tol=1e-4)  # normalised
        ids = server.post("/v1/tokenize", json={"prompt": texts[0]}).json()["tokens"]
        (by_ids,) = client.embed(input_ids=[ids])
        assert max(abs(a - b) for a, b in zip(by_ids, http["data"][0]["embedding"], strict=True)) < 1e-5
        (short,) = client.embed(texts=[texts[0]], dimensions=64)  # --enable-matryoshka
        assert len(short) == 64 and math.isclose(sum(v * v for v in short), 1.0, rel_tol=1e-4)
        with pytest.raises(grpc.RpcError) as bad:
            client.embed(texts=["a"], dimensions=385)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad.value.details().startswith("dimensions:")
        with pytest.raises(grpc.RpcError) as bad:
            client.embed()
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad.value.details().startswith("texts:")
        with pytest.raises(grpc.RpcError) as bad:  # a pooling server does not generate
            list(client.generate(text="x"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
