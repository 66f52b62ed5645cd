"""Scoring routes (vLLM's and SGLang's shapes): ``/v1/rerank``, ``/v1/score`` and ``/classify``.

A scoring model (``--task score``: a ``*ForSequenceClassification`` checkpoint) reads a query and a
document as one text pair, encoded as the tokenizer encodes pairs (``[CLS] a [SEP] b [SEP]`` with
segment ids for BERT cross-encoders), and its one logit becomes the relevance score through the
activation sentence-transformers' ``CrossEncoder`` applies (``score_activation``). An embedding
model (``--task embed``) scores a pair by the cosine similarity of the two texts' vectors, as vLLM
does. ``/classify`` returns a classification model's label and class probabilities. Every input
runs through ``TokenizerManager.embed``, the prefill-only path of ``/v1/embeddings``.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

from engine.entrypoints.http.context import ServingContext
from engine.entrypoints.http.errors import APIError, parse_body
from engine.entrypoints.http.scoring_heads import ScoreHead, score_head
from engine.managers.tokenizer_embed import EmbeddingRequest, EmbeddingResult
from engine.managers.tokenizer_pool import TextTooLongError

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RerankDocument(_Body):
    """A document given as an object (Cohere's and Jina's clients send ``{"text": ...}``)."""

    text: str


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    # The best this many results; None or 0: all of them.
    top_n: int | None = Field(None, ge=0)
    # Echo each document's text in its result.
    return_documents: bool = True
    # Accepted and ignored (bookkeeping).
    user: str | None = None


class ScoreRequest(_Body):
    model: str | None = None
    # One text scored against every text_2, or a list paired one-to-one with text_2.
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None


class ClassifyRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


def _require_scoring(ctx: ServingContext, route: str) -> str:
    """The server's task, when it can serve ``route`` (rerank and score: score or embed)."""
    task = ctx.manager.task
    if task == "generate":
        raise APIError(400, f"{route} needs a scoring model (--task score, e.g. a *ForSequenceClassification "
                            "cross-encoder) or an embedding model (--task embed); this server runs a generation "
                            "model (--task generate)", param="model", code="model_not_supported")
    return task


def _check_texts(ctx: ServingContext, texts: list[str], field: str) -> None:
    """Texts that are not empty and may fit the context (before anything is tokenized)."""
    if not texts:
        raise APIError(400, f"{field}: the list is empty; give at least one text", param=field)
    for i, text in enumerate(texts):
        name = f"{field}[{i}]" if len(texts) > 1 else field
        if not text:
            raise APIError(400, f"{name}: the text is empty", param=field)
        try:
            ctx.manager.pool.check_length(text)
        except TextTooLongError as exc:
            raise APIError(400, f"{name}: {exc}", param=field, code="context_length_exceeded") from None


async def score_pairs(ctx: ServingContext, firsts: list[str], seconds: list[str], field: str,
                      route: str) -> tuple[list[float], int]:
    """The score of each pair ``(firsts[i], seconds[i])`` and the prompt tokens it took.

    ``field`` is the request field the second texts came from (named in errors).
    """
    task = _require_scoring(ctx, route)
    if task == "embed":
        return await _cosine_scores(ctx, firsts, seconds, field)
    head = score_head(ctx)
    if head.num_labels != 1:
        raise APIError(400, f"{route} needs a model with one output (num_labels 1: a cross-encoder or reward "
                            f"model); this model has {head.num_labels} labels ({', '.join(head.labels)}): use "
                            "/classify", param="model", code="model_not_supported")
    tokenizer = ctx.require_tokenizer(field)
    size = sum(len(t) for t in firsts) + sum(len(t) for t in seconds)
    encoded = await ctx.manager.pool.run(_encode_pairs, size, tokenizer, firsts, seconds)
    results = await ctx.manager.embed(EmbeddingRequest(
        inputs=[ids for ids, _ in encoded], token_type_ids=[types for _, types in encoded], field_name=field))
    scores = [head.activate(r.embedding[0]) for r in results]
    return scores, sum(r.prompt_tokens for r in results)


def _encode_pairs(tokenizer: Any, firsts: list[str], seconds: list[str]) -> list[tuple[list[int], list[int] | None]]:
    """Token ids (and segment ids where the tokenizer makes them) of each text pair."""
    out = []
    for a, b in zip(firsts, seconds, strict=True):
        enc = tokenizer(a, b, add_special_tokens=True)
        types = enc.get("token_type_ids")
        out.append((list(enc["input_ids"]), list(types) if types is not None and any(types) else None))
    return out


async def _cosine_scores(ctx: ServingContext, firsts: list[str], seconds: list[str],
                         field: str) -> tuple[list[float], int]:
    """Cosine similarity of each pair's embeddings; each distinct text is embedded once."""
    distinct = list(dict.fromkeys([*firsts, *seconds]))
    results: list[EmbeddingResult] = await ctx.manager.embed(EmbeddingRequest(inputs=list(distinct), field_name=field))
    vectors = {text: r.embedding for text, r in zip(distinct, results, strict=True)}
    scores = [_cosine(vectors[a], vectors[b]) for a, b in zip(firsts, seconds, strict=True)]
    return scores, sum(r.prompt_tokens for r in results)


def _cosine(a: list[float], b: list[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(request: Request) -> Response:
    """Documents ordered by their relevance to the query (best first), at most ``top_n``."""
    ctx = _ctx(request)
    req = parse_body(await request.body(), RerankRequest)
    ctx.check_model(req.model)
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    if not req.documents:
        raise APIError(400, "documents: the list is empty; give at least one document", param="documents")
    _check_texts(ctx, [req.query], "query")
    _check_texts(ctx, texts, "documents")
    scores, tokens = await score_pairs(ctx, [req.query] * len(texts), texts, "documents", "/v1/rerank")
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[: req.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": texts[i]}
        results.append(item)
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": ctx.model_name, "results": results,
                         "usage": _usage(tokens)})


@router.post("/v1/score")
@router.post("/score")
async def score(request: Request) -> Response:
    """Scores of text pairs: ``text_1`` against each ``text_2``, or the two lists one-to-one."""
    ctx = _ctx(request)
    req = parse_body(await request.body(), ScoreRequest)
    ctx.check_model(req.model)
    firsts = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    seconds = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    _check_texts(ctx, firsts, "text_1")
    _check_texts(ctx, seconds, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise APIError(400, f"text_2: {len(seconds)} texts for {len(firsts)} in text_1; accepted: text_1 one text "
                            "(scored against every text_2) or as many texts as text_2 (paired one-to-one)",
                       param="text_2")
    scores, tokens = await score_pairs(ctx, firsts, seconds, "text_2", "/v1/score")
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": ctx.model_name,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": _usage(tokens)})


@router.post("/v1/classify")
@router.post("/classify")
async def classify(request: Request) -> Response:
    """The label and class probabilities of each input (a classification or reward model)."""
    ctx = _ctx(request)
    req = parse_body(await request.body(), ClassifyRequest)
    ctx.check_model(req.model)
    if ctx.manager.task != "score":
        raise APIError(400, f"/classify needs a classification model (--task score, a *ForSequenceClassification "
                            f"checkpoint); this server runs --task {ctx.manager.task}", param="model",
                       code="model_not_supported")
    head: ScoreHead = score_head(ctx)
    inputs: list[Any] = [req.input] if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)) \
        else list(req.input)
    if not inputs:
        raise APIError(400, "input: the list is empty; accepted: a string, a list of strings, a list of token ids "
                            "or a list of lists of token ids", param="input")
    results = await ctx.manager.embed(EmbeddingRequest(inputs=inputs, field_name="input"))
    data = []
    for r in results:
        probs = head.probabilities(r.embedding)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": r.index, "label": head.labels[best], "probs": probs, "num_classes": len(probs),
                     "logits": r.embedding})
    return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": ctx.model_name, "data": data,
                         "usage": _usage(sum(r.prompt_tokens for r in results))})
