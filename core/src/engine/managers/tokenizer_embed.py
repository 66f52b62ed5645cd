"""``TokenizerManager.embed``: pooling requests (embeddings, scores). Mixed into ``TokenizerManager``.

The HTTP routes (/v1/embeddings, /encode), the offline ``Engine.encode`` and the gRPC Embed call
all go through ``embed``: it validates and tokenizes a batch of inputs, sends one
``TokenizedEmbeddingReqInput`` per input and returns their vectors in input order.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.managers.io_struct import AbortReq, BatchEmbeddingOut, TokenizedEmbeddingReqInput


@dataclass
class EmbeddingRequest:
    """A batch of inputs to pool, each a text or a list of token ids."""

    inputs: list[str | list[int]] = field(default_factory=list)
    # Matryoshka size of every vector (None: the model's full size, or its default truncate_dim).
    dimensions: int | None = None
    # Id of the batch (abort by it); each input runs as "<rid>-<index>".
    rid: str | None = None
    priority: int = 0
    # The request field the inputs came from, named in errors ("input" for OpenAI's API).
    field_name: str = "input"
    # Per input given as token ids, its segment ids (text pairs for cross-encoders) or None.
    token_type_ids: list[list[int] | None] | None = None


@dataclass
class EmbeddingResult:
    index: int
    # float32 values as Python floats (L2-normalised where the model's pooling says so).
    embedding: list[float]
    prompt_tokens: int
    cached_tokens: int = 0


class EmbedMixin:
    """Pooling requests of ``TokenizerManager``."""

    # Provided by TokenizerManager.
    ready: Any
    tokenizer: Any
    pool: Any
    states: dict[str, Any]
    router: Any
    sends: list[Any]
    on_route: list[Any]
    on_finish: list[Any]
    dead: str | None

    @property
    def task(self) -> str:
        return getattr(self.ready, "task", "generate")

    def check_generation_task(self, what: str) -> None:
        """Refuses a generation request (``what``: the route) on a pooling server."""
        from engine.managers.request_state import RequestError

        if self.task != "generate":
            raise RequestError(f"{what}: this server serves an embedding/scoring model (--task {self.task}), which "
                               "cannot generate; serve a generation model (--task generate)", "model")

    async def embed(self, req: EmbeddingRequest) -> list[EmbeddingResult]:
        """Pools every input of ``req``; raises ``RequestError`` naming the field on bad input."""
        from engine.managers.request_state import ReqState, RequestError, ServerShuttingDownError

        self._check_alive()  # type: ignore[attr-defined]
        if self.refuses_new():  # type: ignore[attr-defined]
            raise ServerShuttingDownError("the server is shutting down and accepts no new requests")
        if self.task == "generate":
            raise RequestError("this server runs a generation model (--task generate); embeddings need an embedding "
                               "model: start it with --task embed (and --model-path DIR of one)", "model")
        dims = self._check_dimensions(req.dimensions)
        ids_list = [await self._embedding_ids(req, i, item) for i, item in enumerate(req.inputs)]
        if not ids_list:
            raise RequestError(f"{req.field_name}: the list of inputs is empty; accepted: a string, a list of strings, "
                               "a list of token ids or a list of lists of token ids", req.field_name)
        self.start()  # type: ignore[attr-defined]
        base = req.rid or uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(len(ids_list))]
        for rid in rids:
            if rid in self.states:
                raise RequestError(f"rid: a request with id '{rid}' is already running", "rid")
        states = [ReqState(rid, ids) for rid, ids in zip(rids, ids_list)]
        if req.rid:
            self.add_group(req.rid, rids)  # type: ignore[attr-defined]
        for i, state in enumerate(states):
            self.states[state.rid] = state
            decision = self.router.route(state.rid, state.prompt_ids)
            for callback in self.on_route:
                callback(state.rid, decision)
            self.sends[decision.replica].send_pyobj(TokenizedEmbeddingReqInput(
                rid=state.rid, input_ids=state.prompt_ids, dimensions=dims, priority=req.priority,
                token_type_ids=req.token_type_ids[i] if req.token_type_ids else None))
        try:
            await asyncio.gather(*(self._wait_embedding(s) for s in states))
        finally:
            for state in states:
                self.states.pop(state.rid, None)
                self._leave_groups(state.rid)  # type: ignore[attr-defined]
                if state.finished_reason is None and self.dead is None:
                    self._send_for(state.rid, AbortReq(state.rid, "client disconnected"))  # type: ignore[attr-defined]
                self.router.finish(state.rid)
                if state.finished_reason is not None:
                    for callback in self.on_finish:  # metrics: requests, prompt and cached tokens, latency
                        callback(state)
        return [EmbeddingResult(i, s.meta["embedding"], len(s.prompt_ids), s.meta.get("cached_tokens", 0))
                for i, s in enumerate(states)]

    async def _wait_embedding(self, state: Any) -> None:
        from engine.managers.request_state import RequestError

        await state.event.wait()
        if state.error is not None:
            raise state.error
        reason = state.finished_reason or {}
        if reason.get("type") == "abort":
            raise RequestError(f"input: {reason.get('message')}", "input")

    def _handle_embedding_out(self, msg: BatchEmbeddingOut) -> None:
        now = time.perf_counter()
        for i, rid in enumerate(msg.rids):
            state = self.states.get(rid)
            if state is None:
                continue
            error = msg.errors[i]
            state.finished_reason = error or {"type": "length", "length": 0}
            state.meta.update(embedding=msg.embeddings[i], prompt_tokens=msg.prompt_tokens[i],
                              cached_tokens=msg.cached_tokens[i], completion_tokens=0)
            state.last_time = now
            state.event.set()

    def _check_dimensions(self, dims: Any) -> int | None:
        from engine.managers.request_state import RequestError

        pooling = getattr(self.ready, "pooling", {}) or {}
        size = getattr(self.ready, "embedding_size", 0)
        if dims is None:
            return pooling.get("default_dimensions")
        if isinstance(dims, bool) or not isinstance(dims, int) or not 0 < dims <= size:
            raise RequestError(f"dimensions: invalid value {dims!r}; accepted: an integer from 1 to {size} "
                               "(this model's vector size)", "dimensions")
        if self.task != "embed":
            raise RequestError(f"dimensions: not accepted by a scoring model (--task {self.task})", "dimensions")
        if not pooling.get("matryoshka"):
            raise RequestError(f"dimensions: invalid value {dims}; this model does not declare Matryoshka training "
                               "(config.json is_matryoshka or matryoshka_dimensions), so truncated vectors lose "
                               "meaning; start the server with --enable-matryoshka to allow it", "dimensions")
        sizes = pooling.get("matryoshka_dimensions")
        if sizes and dims not in sizes:
            raise RequestError(f"dimensions: invalid value {dims}; accepted for this model: "
                               f"{', '.join(map(str, sizes))}", "dimensions")
        return dims

    async def _embedding_ids(self, req: EmbeddingRequest, index: int, item: Any) -> list[int]:
        from engine.managers.request_state import RequestError
        from engine.managers.tokenizer_pool import TextTooLongError

        name = f"{req.field_name}[{index}]" if len(req.inputs) > 1 else req.field_name
        limit = self.ready.context_len
        if isinstance(item, str):
            if not item:
                raise RequestError(f"{name}: the text is empty", req.field_name)
            if self.tokenizer is None:
                raise RequestError(f"{name}: this server runs with --skip-tokenizer-init; send token ids",
                                   req.field_name)
            try:
                ids = await self.pool.encode(item)
            except TextTooLongError as exc:
                raise RequestError(f"{name}: {exc}", req.field_name) from None
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids = list(item)
            if not ids:
                raise RequestError(f"{name}: the list of token ids is empty", req.field_name)
            vocab = self.ready.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"{name}: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                   req.field_name)
        else:
            raise RequestError(f"{name}: invalid value of type {type(item).__name__}; accepted: a string or a list "
                               "of token ids", req.field_name)
        if len(ids) > limit:
            raise RequestError(f"{name}: the input has {len(ids)} tokens; this model's context length is {limit}",
                               req.field_name)
        return ids
