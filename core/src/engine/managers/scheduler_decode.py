"""Decode steps of the scheduler: synchronous, or overlapped with the next step's launch.

With overlap, decode step N+1 is launched (its input ids are step N's sampled ids,
still on the device) before step N's tokens are appended on the host; see
docs/architecture.md. Mixed into ``Scheduler``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.layers.sampler import SampleOutput
from engine.managers.logprobs import record_output_logprobs
from engine.managers.schedule_batch import FinishReason, Req, ScheduleBatch
from engine.platforms import device_event
from engine.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

_MIN_NEW_TOKEN_RATIO = 0.1
_NEW_TOKEN_RATIO_DECAY = 0.001


@dataclass
class InflightDecode:
    """A launched decode step whose tokens have not been appended yet."""

    reqs: list[Req]
    sample: SampleOutput
    info: SamplingBatchInfo
    # Host copy of the sampled ids, filled asynchronously; ``ready`` is recorded after the copy
    # so processing waits for this step only, not for the step launched after it.
    host_ids: torch.Tensor | None = None
    ready: Any = None

    @classmethod
    def start(cls, reqs: list[Req], sample: SampleOutput, info: SamplingBatchInfo) -> InflightDecode:
        """Wraps a launched step and starts the asynchronous host copy of its sampled ids."""
        step = cls(list(reqs), sample, info)
        ids = sample.next_token_ids
        if ids.is_cuda:
            step.host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            step.host_ids.copy_(ids, non_blocking=True)
            step.ready = device_event(ids.device)
            step.ready.record()
        return step

    def token_ids(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return (self.host_ids if self.host_ids is not None else self.sample.next_token_ids).tolist()


class DecodeMixin:
    """The decode half of ``Scheduler`` (uses its pools, cache, runner and queues)."""

    # Provided by Scheduler.
    runner: Any
    allocator: Any
    tree_cache: Any
    req_to_token_pool: Any
    running_batch: ScheduleBatch
    waiting_queue: list[Req]
    enable_overlap: bool
    inflight: InflightDecode | None
    grammar_queue: Any
    speculator: Any

    def run_decode(self) -> None:
        """One decode step; with overlap, launches step N+1 before processing step N."""
        started = time.perf_counter()
        spec = self.speculator
        if self.enable_overlap and (spec is None or not spec.may_speculate(self.running_batch)):
            if spec is not None:
                spec.stats.fallback_steps += 1
            self._run_decode_overlap()
        else:
            # A verify step starts from the settled batch: its drafts continue the last token.
            self.drain()
            batch = self.running_batch
            self._ensure_decode_memory(batch)
            if batch.reqs:
                info = self._decode_sampling_info(batch) if self.speculator is not None else None
                rows = self.speculator.try_step(batch, info) if info is not None else None
                if rows is not None:
                    self._finish_spec_decode(rows)
                else:
                    self._process_decode(self._launch_decode(batch, None, lag=0, info=info))
                batch.filter()
        # Overlapped, this waits for the previous step: in a steady state, one device step.
        self.decode_time_s += time.perf_counter() - started

    def _launch_decode(self, batch: ScheduleBatch, input_ids: Any, lag: int,
                       info: SamplingBatchInfo | None = None, prev: InflightDecode | None = None) -> InflightDecode:
        """Prepares and launches a decode step; ``lag`` = tokens sampled but not yet appended.

        ``prev`` (overlap, constrained rows in the batch): the previous step, processed after
        this step's forward is launched and before it samples. Its tokens must reach the
        grammar matchers before this step's bitmask can be filled, so the host does that work
        while the device runs the forward (SGLang's order), then the mask is applied and the
        step samples.
        """
        fb = batch.prepare_for_decode(lag=lag, input_ids=input_ids)
        if info is None:
            info = self._decode_sampling_info(batch)
        info.steps = [len(r.output_ids) + lag for r in batch.reqs]
        fb.sampling_info = info
        for req in batch.reqs:  # the step holds a KV slot per row from here on
            req.inflight_steps += 1
        logits = self.runner.forward(fb)
        if self.speculator is not None:
            self.speculator.hand_hidden_states(batch.reqs, fb, logits)
        if prev is not None:
            self._process_decode(prev)
        self.grammar_queue.set_mask(info, batch.reqs)
        sample = self.runner.sample(logits, fb)
        if info.penalizer is not None:
            info.penalizer.cumulate_output_tokens(sample.next_token_ids)
        self.forward_steps += 1
        self.decode_steps += 1
        self.overlapped_decode_steps += lag
        self.decode_rows += len(batch.reqs)
        return InflightDecode.start(batch.reqs, sample, info)

    def _finish_spec_decode(self, rows: list[Req]) -> None:
        """Counts and emits a speculative decode step (``engine.speculative.worker``)."""
        self.forward_steps += 1
        self.decode_steps += 1
        self.decode_rows += len(rows)
        self._emit(rows)
        self.new_token_ratio = max(min(_MIN_NEW_TOKEN_RATIO, self.init_new_token_ratio),
                                   self.new_token_ratio - _NEW_TOKEN_RATIO_DECAY)

    def _process_decode(self, step: InflightDecode) -> None:
        """Appends a launched step's tokens (waits for the device) and finishes requests."""
        ids = step.token_ids()
        # Constrained rows' matchers take their tokens in one batch call (finished rows: none).
        accepted = self.grammar_queue.accept_tokens(step.reqs, ids)
        live: list[Req] = []
        for i, req in enumerate(step.reqs):
            req.inflight_steps -= 1
            if req.finished():
                continue  # finished (or aborted) after this step was launched
            req.append_output(ids[i], accepted[i])
            record_output_logprobs(req, i, step.sample)
            req.check_finished()
            if req.finished():
                if req.inflight_steps:
                    # A later step already took KV for this request's position seqlen-1: give
                    # back the pages that position opened (a page it shares with kept tokens is
                    # released with them by the cache).
                    ps = self.allocator.page_size
                    first = req.seqlen - 1
                    opened = [p for p in range(first, first + req.inflight_steps) if p % ps == 0]
                    if opened:
                        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
                        self.allocator.free(row[opened].long())
                self.tree_cache.cache_finished_req(req)
            live.append(req)
        self._emit(live)
        self.new_token_ratio = max(min(_MIN_NEW_TOKEN_RATIO, self.init_new_token_ratio),
                                   self.new_token_ratio - _NEW_TOKEN_RATIO_DECAY)

    def drain(self) -> None:
        """Processes the in-flight decode step, if any (overlap mode)."""
        step, self.inflight = self.inflight, None
        if step is not None:
            self._process_decode(step)
            self.running_batch.filter()

    def _run_decode_overlap(self) -> None:
        prev = self.inflight
        batch = self.running_batch
        if prev is not None:
            keep = [i for i, r in enumerate(prev.reqs) if not r.finished()]
            same_rows = [prev.reqs[i] for i in keep] == [r for r in batch.reqs if not r.finished()]
            enough = (self.allocator.available_size() + self.tree_cache.evictable_size()
                      >= batch.decode_tokens_needed())
            if not (same_rows and keep and enough):
                self.drain()
                prev = None
        if prev is None:
            self._ensure_decode_memory(batch)
            if batch.reqs:
                self.inflight = self._launch_decode(batch, None, lag=0)
            return
        batch.filter([prev.reqs[i] for i in keep])
        ids = prev.sample.next_token_ids
        info = prev.info
        if len(keep) != len(prev.reqs):
            keep_t = torch.tensor(keep, dtype=torch.int64, device=ids.device)
            ids = ids.index_select(0, keep_t)
            info = info.filter(keep)
        if any(r.grammar is not None for r in batch.reqs):
            self.inflight = self._launch_decode(batch, ids, lag=1, info=info, prev=prev)
        else:
            self.inflight = self._launch_decode(batch, ids, lag=1, info=info)
            self._process_decode(prev)
        batch.filter()
        batch._sampling_cache = None  # type: ignore[attr-defined]  (rows may have finished)

    def _decode_sampling_info(self, batch: ScheduleBatch) -> SamplingBatchInfo:
        # Rebuilt only when the batch's membership changed; penalty counts carry over otherwise.
        # Keyed by arrival number, unique per request (an id() can be reused by a new request).
        key = [r.arrival_seq for r in batch.reqs]
        cached = getattr(batch, "_sampling_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        info = SamplingBatchInfo.from_reqs(batch.reqs, self.runner.vocab_size, self.device, self.eos_token_ids)
        batch._sampling_cache = (key, info)  # type: ignore[attr-defined]
        return info

    def _ensure_decode_memory(self, batch: ScheduleBatch) -> None:
        """Retracts requests until the next decode step's KV slots can be found."""
        def enough() -> bool:
            return self.allocator.available_size() + self.tree_cache.evictable_size() >= batch.decode_tokens_needed()

        if enough():
            return
        # Retract the requests that cost least to redo: fewest generated tokens first.
        order = sorted(batch.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        retracted: list[Req] = []
        while not enough() and len(order) > 1:
            req = order.pop()
            self._retract([req])
            retracted.append(req)
        if not enough():
            # A lone request that cannot grow: it does not fit the pool at all.
            req = order.pop()
            req.finished_reason = FinishReason("abort", message="out of KV cache memory for this request")
            self.tree_cache.cache_finished_req(req)
            self._emit([req])
        batch.filter([r for r in order if not r.finished()])
        if retracted:
            logger.info("retracted %d requests (KV memory full)", len(retracted))
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1 * len(retracted))
