"""Prefill-only requests of pooling models (``--task embed|score``). Mixed into ``Scheduler``.

An embedding request is admitted, chunked and batched like a generation request's prefill; its
extend step runs the model to the token states instead of logits, reduces them into the
request's ``PoolState`` and, after the last chunk, frees the request's KV (decoder models leave
it in the radix cache for the next request with the same prefix) and sends the vector straight
to the tokenizer manager (``BatchEmbeddingOut``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.layers.pooler import PoolState
from engine.managers.io_struct import BatchEmbeddingOut, TokenizedEmbeddingReqInput
from engine.managers.schedule_batch import FinishReason, OutOfKVMemory, Req, ScheduleBatch
from engine.sampling.sampling_params import SamplingParams


class PoolingMixin:
    """``add_embedding_request``, ``run_pooling`` and ``_emit_pooled`` of the scheduler."""

    # Provided by Scheduler.
    args: Any
    runner: Any
    tree_cache: Any
    reqs: dict[str, Req]
    waiting_queue: list[Req]
    outbox: list[Any]
    forward_steps: int
    extend_tokens: int
    extend_time_s: float

    def add_embedding_request(self, recv: TokenizedEmbeddingReqInput) -> None:
        params = SamplingParams(max_new_tokens=0)
        # A scoring model may leave out tokens its head never reads (trailing padding).
        trim = getattr(self.runner.model, "pooling_input", None)
        input_ids = trim(recv.input_ids) if callable(trim) else recv.input_ids
        req = Req(recv.rid, input_ids, params, set(), priority=recv.priority)
        req.pool_state = PoolState()
        req.dimensions = recv.dimensions
        req.token_type_ids = recv.token_type_ids
        pooler = self.runner.pooler
        req.pool_every_token = pooler is not None and pooler.needs_every_token
        self.reqs[req.rid] = req
        error = self._validate_pooling(req)
        if error:
            req.finished_reason = FinishReason("abort", message=error)
            self._emit_pooled([req])
            return
        self.waiting_queue.append(req)

    def _validate_pooling(self, req: Req) -> str | None:
        """The scheduler's backstop; the tokenizer manager checks the same before sending."""
        if self.runner.pooler is None:
            return f"this server runs --task {self.runner.task}; embeddings need --task embed or score"
        n = len(req.origin_input_ids)
        if n == 0:
            return "the input is empty"
        if n > self.runner.context_len:
            return f"the input has {n} tokens; this model's context length is {self.runner.context_len}"
        if n > self.runner.max_total_num_tokens:
            return f"the input has {n} tokens but the KV pool holds {self.runner.max_total_num_tokens}"
        vocab = self.runner.vocab_size
        bad = next((t for t in req.origin_input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary (0..{vocab - 1})"
        if req.dimensions is not None and not 0 < req.dimensions <= self.runner.embedding_size:
            return f"dimensions {req.dimensions}; accepted: 1..{self.runner.embedding_size}"
        return None

    def run_pooling(self, batch: ScheduleBatch) -> bool:
        """Runs a prefill batch of pooling requests; False when its KV could not be allocated."""
        started = time.perf_counter()
        try:
            fb = batch.prepare_for_extend()
        except OutOfKVMemory:
            self._requeue_failed_extend(batch)  # type: ignore[attr-defined]
            return False
        if any(r.token_type_ids for r in batch.reqs):
            fb.extra["token_type_ids"] = _segment_ids(batch.reqs, fb.input_ids.device)
        hidden = self.runner.forward_hidden(fb)
        pooler = self.runner.pooler
        pooler.add_batch([r.pool_state for r in batch.reqs], hidden, list(fb.extend_seq_lens_cpu or []))
        self.forward_steps += 1
        self.extend_tokens += sum(r.extend_input_len for r in batch.reqs)
        done = []
        for req in batch.reqs:
            if req.is_chunked > 0:
                self.tree_cache.cache_unfinished_req(req)
                continue
            req.finished_reason = FinishReason("length", length=0)
            self.tree_cache.cache_finished_req(req)
            done.append(req)
        self._emit_pooled(done)
        self.extend_time_s += time.perf_counter() - started
        return True

    def _emit_pooled(self, reqs: list[Req]) -> None:
        """Queues the vectors of finished pooling requests (and the errors of failed ones)."""
        if not reqs:
            return
        ok = [r for r in reqs if r.finished_reason is not None and r.finished_reason.kind != "abort"]
        vectors = self.runner.pooler.finish([r.pool_state for r in ok], [r.dimensions for r in ok]) if ok else []
        by_rid = {r.rid: v.tolist() for r, v in zip(ok, vectors)}
        out = BatchEmbeddingOut(rids=[], embeddings=[], errors=[], prompt_tokens=[], cached_tokens=[])
        for req in reqs:
            out.rids.append(req.rid)
            out.embeddings.append(by_rid.get(req.rid))
            reason = req.finished_reason
            out.errors.append(reason.to_json() if reason is not None and reason.kind == "abort" else None)
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.cached_tokens.append(req.cached_tokens)
            self.reqs.pop(req.rid, None)
        self.outbox.append(out)


def _segment_ids(reqs: list[Req], device: Any) -> torch.Tensor:
    """The batch's segment id per new token (``ForwardBatch.extra["token_type_ids"]``): each
    request's ids for the tokens this step runs, 0 for requests without any."""
    ids: list[int] = []
    for req in reqs:
        start = len(req.prefix_indices)
        types = req.token_type_ids
        ids.extend(types[start:start + req.extend_input_len] if types else [0] * req.extend_input_len)
    return torch.tensor(ids, dtype=torch.int64, device=device)
