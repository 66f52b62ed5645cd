"""A small blocking client of ``plugserve.v1.Engine`` (``engine serve --grpc-port N``).

    from engine_grpc.client import Client, collect

    with Client("127.0.0.1:50051", api_key="KEY") as client:
        call = client.generate(text="Hello", sampling_params={"max_new_tokens": 8}, stream=True)
        for response in call:          # call.cancel() aborts the request
            print(response.text, end="")

The generated modules (``plugserve_pb2``, ``plugserve_pb2_grpc``) work with any gRPC channel,
``grpc.aio`` ones included; this wraps a channel for the common calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine_grpc import plugserve_pb2 as pb
from engine_grpc import plugserve_pb2_grpc as pb_grpc


class Client:
    """One channel to a server; ``api_key`` is sent as ``authorization: Bearer KEY``."""

    def __init__(self, target: str, api_key: str | None = None, timeout: float | None = None,
                 channel: grpc.Channel | None = None) -> None:
        self.channel = channel or grpc.insecure_channel(target)
        self.stub = pb_grpc.EngineStub(self.channel)
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def generate(self, text: str | None = None, input_ids: list[int] | None = None,
                 sampling_params: dict[str, Any] | None = None, stream: bool = False, rid: str = "",
                 **fields: Any) -> Any:
        """Starts a Generate call; iterate it for the ``GenerateResponse``s, ``cancel()`` it to
        abort the request. ``fields`` are further GenerateRequest fields (``priority``,
        ``return_logprob``, ``top_logprobs_num``)."""
        request = pb.GenerateRequest(sampling_params=pb.SamplingParams(**(sampling_params or {})),
                                     stream=stream, rid=rid, **fields)
        if text is not None:
            request.text = text
        if input_ids is not None:
            request.input_ids.ids.extend(input_ids)
        return self.stub.Generate(request, metadata=self.metadata, timeout=self.timeout)

    def embed(self, texts: list[str] | None = None, input_ids: list[list[int]] | None = None,
              dimensions: int | None = None, rid: str = "") -> list[list[float]]:
        """The vector of each input (texts, or token-id lists), in order; on a ``--task embed``
        server. The whole reply (token counts too) is ``stub.Embed``'s."""
        request = pb.EmbedRequest(texts=texts or [], input_ids=[pb.TokenIds(ids=ids) for ids in input_ids or []],
                                  rid=rid)
        if dimensions is not None:
            request.dimensions = dimensions
        reply = self.stub.Embed(request, metadata=self.metadata, timeout=self.timeout)
        return [list(e.values) for e in reply.embeddings]

    def abort(self, rid: str) -> list[str]:
        """Aborts the running request ``rid``; returns the ids aborted (NOT_FOUND: none runs)."""
        reply = self.stub.Abort(pb.AbortRequest(rid=rid), metadata=self.metadata, timeout=self.timeout)
        return list(reply.aborted_rids)

    def health(self) -> str:
        """``ok``; raises ``grpc.RpcError`` (UNAVAILABLE) when the server is unhealthy."""
        return self.stub.Health(pb.HealthRequest(), metadata=self.metadata, timeout=self.timeout).status

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata, timeout=self.timeout)

    def server_info(self) -> dict[str, Any]:
        """The /get_server_info document."""
        reply = self.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self.metadata, timeout=self.timeout)
        return json.loads(reply.json)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Output:
    """One choice's whole output, joined from its responses."""

    rid: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    # With logprob_start_len: the prompt's, from that position.
    input_logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    # The last response's counts and finish reason ("" while it runs).
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    matched: int | str | None = None


def collect(responses: Iterable[pb.GenerateResponse]) -> list[Output]:
    """Joins a Generate call's responses into one Output per choice, in choice order."""
    outputs: dict[int, Output] = {}
    for response in responses:
        out = outputs.setdefault(response.index, Output(rid=response.rid))
        out.text += response.text
        out.token_ids.extend(response.token_ids)
        out.logprobs.extend(response.logprobs)
        out.input_logprobs.extend(response.input_logprobs)
        out.prompt_tokens, out.completion_tokens = response.prompt_tokens, response.completion_tokens
        out.cached_tokens = response.cached_tokens
        if response.HasField("finish_reason"):
            reason = response.finish_reason
            out.finish_reason = reason.type
            which = reason.WhichOneof("matched")
            out.matched = getattr(reason, which) if which else None
    return [outputs[i] for i in sorted(outputs)]


def iter_text(responses: Iterable[pb.GenerateResponse]) -> Iterator[str]:
    """The text of a one-choice call as it arrives."""
    for response in responses:
        if response.text:
            yield response.text


__all__ = ["Client", "Output", "collect", "iter_text"]
