"""Messages of ``plugserve.proto`` to and from the dicts of the native HTTP API.

A ``GenerateRequest`` becomes a ``/generate`` body, so the engine validates it with the same
code and the same messages (naming the field) as HTTP; the outputs ``/generate`` streams
(cumulative text and ids) become responses carrying what is new since a choice's previous one.
"""

from __future__ import annotations

import json
import math
from typing import Any

from engine.entrypoints.frontend import APIError
from engine_grpc import plugserve_pb2 as pb


def generate_body(request: pb.GenerateRequest) -> dict[str, Any]:
    """The ``/generate`` body asking what ``request`` asks."""
    body: dict[str, Any] = {"stream": request.stream}
    prompt = request.WhichOneof("prompt")
    if prompt == "text":
        body["text"] = request.text
    elif prompt == "input_ids":
        body["input_ids"] = list(request.input_ids.ids)
    body["sampling_params"] = sampling_params(request.sampling_params)
    if request.rid:
        body["rid"] = request.rid
    if request.priority:
        body["priority"] = request.priority
    if request.return_logprob or request.top_logprobs_num:
        body["return_logprob"] = True
        body["top_logprobs_num"] = request.top_logprobs_num
    if request.HasField("logprob_start_len"):
        body["logprob_start_len"] = request.logprob_start_len
    return body


def sampling_params(params: pb.SamplingParams) -> dict[str, Any]:
    """The fields set (scalars), or non-empty (lists, maps), under their own names."""
    out: dict[str, Any] = {}
    for field in params.DESCRIPTOR.fields:
        value = getattr(params, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            if value:
                out[field.name] = {str(k): v for k, v in value.items()}
        elif field.is_repeated:
            if value:
                out[field.name] = list(value)
        elif params.HasField(field.name):
            out[field.name] = value
    return out


class ResponseBuilder:
    """Turns the cumulative outputs of a generation's choices into responses holding only what
    is new since each choice's previous response."""

    def __init__(self) -> None:
        # Per choice index: how many ids, characters and logprob entries were already sent.
        self._sent: dict[int, tuple[int, int, int]] = {}

    def response(self, out: dict[str, Any]) -> pb.GenerateResponse:
        index = out["index"]
        meta = out["meta_info"]
        ids, text = out["output_ids"], out["text"]
        first = index not in self._sent
        sent_ids, sent_chars, sent_logprobs = self._sent.get(index, (0, 0, 0))
        logprobs = meta.get("output_token_logprobs") or []
        self._sent[index] = (len(ids), len(text), len(logprobs))
        response = pb.GenerateResponse(
            rid=str(meta.get("id") or ""), index=index, token_ids=ids[sent_ids:], text=text[sent_chars:],
            prompt_tokens=meta.get("prompt_tokens", 0), completion_tokens=meta.get("completion_tokens", 0),
            cached_tokens=meta.get("cached_tokens", 0), e2e_latency=meta.get("e2e_latency", 0.0))
        response.logprobs.extend(_token_logprobs(logprobs, meta.get("output_top_logprobs"), sent_logprobs))
        if first:
            response.input_logprobs.extend(
                _token_logprobs(meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs"), 0))
        reason = meta.get("finish_reason")
        if reason is not None:
            response.finish_reason.CopyFrom(finish_reason(reason))
        return response


def finish_reason(reason: dict[str, Any]) -> pb.FinishReason:
    """SGLang's ``{"type": ..., "matched": ..., "message": ...}``: ``stop``, ``length`` or ``abort``."""
    out = pb.FinishReason(type=str(reason.get("type") or ""), message=str(reason.get("message") or ""))
    matched = reason.get("matched")
    if isinstance(matched, bool) or matched is None:
        pass
    elif isinstance(matched, int):
        out.matched_token_id = matched
    elif isinstance(matched, str):
        out.matched_text = matched
    return out


def _token_logprobs(entries: list[Any], tops: list[Any] | None, start: int) -> list[pb.TokenLogprob]:
    """``[logprob, token_id, text]`` entries (and their top alternatives) from ``start`` on."""
    tops = tops or []
    out = []
    for i in range(start, len(entries)):
        top = tops[i] if i < len(tops) and tops[i] else []
        out.append(pb.TokenLogprob(token_id=entries[i][1], logprob=_logprob(entries[i][0]),
                                   top=[pb.TopLogprob(token_id=t[1], logprob=_logprob(t[0])) for t in top]))
    return out


def _logprob(value: float | None) -> float:
    return math.nan if value is None else float(value)


def embed_inputs(request: pb.EmbedRequest) -> tuple[list[str | list[int]], str]:
    """The inputs and the field they came from (named in errors); both or neither is a 400."""
    if request.texts and request.input_ids:
        raise APIError(400, "texts: give texts or input_ids, not both", param="texts")
    if request.input_ids:
        return [list(ids.ids) for ids in request.input_ids], "input_ids"
    if not request.texts:
        raise APIError(400, "texts: required (or input_ids): the inputs to embed", param="texts")
    return list(request.texts), "texts"


def embed_response(results: list[dict[str, Any]]) -> pb.EmbedResponse:
    response = pb.EmbedResponse(prompt_tokens=sum(r["prompt_tokens"] for r in results))
    for r in results:
        response.embeddings.append(pb.Embedding(values=r["embedding"], index=r["index"],
                                                prompt_tokens=r["prompt_tokens"], cached_tokens=r["cached_tokens"]))
    return response


def model_info(info: dict[str, Any]) -> pb.ModelInfo:
    return pb.ModelInfo(
        model_path=str(info.get("model_path") or ""), served_model_name=str(info.get("served_model_name") or ""),
        tokenizer_path=str(info.get("tokenizer_path") or ""), is_generation=bool(info.get("is_generation")),
        context_len=int(info.get("context_len") or 0), chat_template=info.get("chat_template") or "",
        special_tokens={str(k): str(v) for k, v in (info.get("special_tokens") or {}).items()})


def server_info(info: dict[str, Any]) -> pb.ServerInfo:
    def number(key: str) -> int:
        return int(info.get(key) or 0)

    return pb.ServerInfo(
        version=str(info.get("version") or ""), served_model_name=str(info.get("served_model_name") or ""),
        model_path=str(info.get("model_path") or ""), context_len=number("context_len"),
        max_running_requests=number("max_running_requests"), max_total_num_tokens=number("max_total_num_tokens"),
        num_running_reqs=number("num_running_reqs"), num_waiting_reqs=number("num_waiting_reqs"),
        kv_used_tokens=number("kv_used_tokens"), json=json.dumps(info, default=str))


__all__ = ["ResponseBuilder", "embed_inputs", "embed_response", "finish_reason", "generate_body", "model_info",
           "sampling_params", "server_info"]
