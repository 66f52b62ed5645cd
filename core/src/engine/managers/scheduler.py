"""The scheduler: continuous batching with chunked prefill over a prefix cache.

One ``step()``: admit waiting requests into a prefill (EXTEND) batch under the
token budgets, or else run one DECODE step of the running batch (retracting
requests when KV memory runs out), then sample, append, check finish and queue
outputs for the detokenizer. ``scheduler_process`` wraps it in the ZeroMQ loop;
tests drive it directly.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import torch

from engine import plugins
from engine.config import ServerArgs
from engine.hookspecs import resolve_factory
from engine.layers.sampler import SampleOutput
from engine.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from engine.managers.logprobs import record_output_logprobs, record_prompt_logprobs
from engine.managers.policy import PolicyContext
from engine.managers.schedule_batch import FinishReason, OutOfKVMemory, Req, ScheduleBatch
from engine.model_executor.model_runner import ModelRunner
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Future decode tokens reserved per running request are clipped to this.
_RESERVE_CLIP = 4096
_INIT_NEW_TOKEN_RATIO = 0.7
_MIN_NEW_TOKEN_RATIO = 0.1
_NEW_TOKEN_RATIO_DECAY = 0.001
# Identical prompts at least this long are prefilled once per round (n > 1 sharing).
_SHARE_MIN_PROMPT = 8


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

    def token_ids(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return (self.host_ids if self.host_ids is not None else self.sample.next_token_ids).tolist()


def eos_token_ids_of(model_path: str, hf_config: Any) -> set[int]:
    """EOS ids from config.json and generation_config.json (what HF generate stops on)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    try:
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except Exception:  # no generation_config.json: config.json's ids suffice
        pass
    return ids


class Scheduler:
    def __init__(self, args: ServerArgs, model_path: str, platform: Any | None = None) -> None:
        self.args = args
        self.runner = ModelRunner(args, model_path, platform)
        self.device = self.runner.device
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.allocator = self.runner.token_to_kv_pool_allocator
        self.max_running_requests = self.runner.max_running_requests
        self.context_len = self.runner.context_len
        self.eos_token_ids = eos_token_ids_of(model_path, self.runner.hf_config)
        self.tree_cache = self._create_cache()
        spec = plugins.get_schedule_policy(args.schedule_policy, args.disable_plugin)
        self.policy = resolve_factory(spec.factory)()
        self.policy.cache_aware = spec.cache_aware
        self.policy_ctx = PolicyContext(
            parent_of=lambda node: getattr(node, "parent", None),
            rng=random.Random(args.random_seed),
            enable_preemption=args.enable_priority_preemption)
        self.waiting_queue: list[Req] = []
        self.running_batch = self._new_batch([])
        self.chunked_req: Req | None = None
        self.init_new_token_ratio = min(1.0, _INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness)
        self.new_token_ratio = self.init_new_token_ratio
        self.outbox: list[BatchTokenIDOut] = []
        # Overlap: the CPU launches decode step N+1 before processing step N's tokens.
        self.enable_overlap = (not args.disable_overlap_schedule
                               and self.runner.platform.supports_overlap_schedule())
        self.inflight: InflightDecode | None = None
        self.reqs: dict[str, Req] = {}
        self.pending_aborts: dict[str, str] = {}
        # Counters for /get_server_info and metrics.
        self.num_retractions = 0
        self.forward_steps = 0

    def _create_cache(self) -> Any:
        from engine.mem_cache.chunk_cache import ChunkCache
        from engine.mem_cache.radix_cache import RadixCache

        if self.args.disable_radix_cache:
            return ChunkCache(self.req_to_token_pool, self.allocator, self.args.page_size)
        return RadixCache(self.req_to_token_pool, self.allocator, self.args.page_size,
                          eviction_policy=self.args.radix_eviction_policy)

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(reqs, self.req_to_token_pool, self.allocator, self.tree_cache, self.device)

    # -- input ---------------------------------------------------------------
    def add_request(self, recv: TokenizedGenerateReqInput) -> None:
        params = SamplingParams.from_dict(recv.sampling_params)
        req = Req(recv.rid, recv.input_ids, params, self.eos_token_ids, recv.return_logprob,
                  recv.logprob_start_len, recv.top_logprobs_num, recv.stream, recv.priority)
        self.reqs[req.rid] = req
        error = self._validate(req)
        if error:
            req.finished_reason = FinishReason("abort", message=error)
            self._emit([req])
            return
        # Leave room for at least the prompt and one token within the context.
        params.max_new_tokens = min(params.max_new_tokens, self.context_len - len(req.origin_input_ids))
        self.waiting_queue.append(req)

    def _validate(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.context_len:
            return f"the prompt has {n} tokens; this model's context length is {self.context_len}"
        if n + 1 > self.runner.max_total_num_tokens:
            return f"the prompt has {n} tokens but the KV pool holds {self.runner.max_total_num_tokens}"
        vocab = self.runner.vocab_size
        bad = next((t for t in req.origin_input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary (0..{vocab - 1})"
        return None

    def abort_request(self, rid: str, message: str = "aborted") -> None:
        """Aborts one request (or all with rid ''); its KV is freed at the next step."""
        targets = list(self.reqs) if rid == "" else [rid]
        for r in targets:
            if r in self.reqs:
                self.pending_aborts[r] = message

    def _apply_aborts(self) -> None:
        if not self.pending_aborts:
            return
        aborted: list[Req] = []
        for rid, message in self.pending_aborts.items():
            req = self.reqs.get(rid)
            if req is None or req.finished():
                continue
            req.finished_reason = FinishReason("abort", message=message)
            aborted.append(req)
            if req in self.waiting_queue:
                self.waiting_queue.remove(req)
            elif req is self.chunked_req:
                self._release_partial(req)
                self.chunked_req = None
            elif req in self.running_batch.reqs:
                self.tree_cache.cache_finished_req(req)
        self.pending_aborts.clear()
        self.running_batch.filter()
        self._emit(aborted)

    def _release_partial(self, req: Req) -> None:
        """Frees a request stopped in the middle of a chunked prefill (KV exists for fill_ids)."""
        self.tree_cache.cache_finished_req(req)

    # -- the loop --------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running_batch.reqs or self.chunked_req
                    or self.pending_aborts or self.inflight)

    def step(self) -> bool:
        """Runs one batch; returns False when there was nothing to do."""
        if self.pending_aborts:
            self.drain()
            self._apply_aborts()
        if self.waiting_queue or self.chunked_req is not None:
            # Admission reads and may change the running batch: settle the in-flight step first.
            self.drain()
        batch = self.get_new_batch_prefill()
        if batch is not None and self.run_extend(batch):
            return True
        if self.running_batch.reqs:
            self.run_decode()
            return True
        if self.inflight is not None:
            self.drain()
            return True
        return False

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise RuntimeError("scheduler did not become idle")

    def take_outputs(self) -> list[BatchTokenIDOut]:
        out, self.outbox = self.outbox, []
        return out

    # -- admission ---------------------------------------------------------------
    def _reserve(self, req: Req) -> int:
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return int(min(max(left, 0), _RESERVE_CLIP) * self.new_token_ratio)

    def _order_waiting(self) -> None:
        if self.policy.needs_prefix_match(len(self.waiting_queue)):
            for req in self.waiting_queue:
                # Retracted requests resume from prompt + output: match what admission will.
                tokens = req.origin_input_ids + req.output_ids
                match = self.tree_cache.match_prefix(tokens[:-1])
                req.prefix_len_hint, req.last_node = len(match.device_indices), match.last_node
        self.waiting_queue = self.policy.order(self.waiting_queue, self.policy_ctx)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        if self.waiting_queue:
            self._order_waiting()
            self._preempt_for_waiting()
        running = len(self.running_batch.reqs)
        if running >= self.max_running_requests and self.chunked_req is None:
            return None
        page = self.args.page_size
        reserved = sum(self._reserve(r) for r in self.running_batch.reqs)
        admitted_cost = 0

        def rem_total() -> int:
            # Live: locking an admitted request's prefix makes it unevictable.
            return (self.allocator.available_size() + self.tree_cache.evictable_size()
                    - reserved - admitted_cost)

        rem_input = self.args.max_prefill_tokens
        rem_chunk = self.args.chunked_prefill_size if self.args.chunked_prefill_enabled else 1 << 62
        can_run: list[Req] = []
        new_chunked: Req | None = None

        def take_chunk(req: Req, budget: int) -> bool:
            """Truncates req to a chunk of ``budget`` tokens; True when it still has more."""
            budget = budget // page * page if page > 1 else budget
            if req.extend_input_len <= budget:
                return False
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + budget]
            req.extend_input_len = budget
            return True

        if self.chunked_req is not None:
            req = self.chunked_req
            req.init_next_round_input(None)
            if take_chunk(req, rem_chunk):
                req.is_chunked += 1
                new_chunked = req
            else:
                req.is_chunked = 0
            can_run.append(req)
            admitted_cost += req.extend_input_len + self._reserve(req)
            rem_input -= req.extend_input_len
            rem_chunk -= req.extend_input_len

        if new_chunked is None:
            # Prompts admitted in this round: an identical prompt (parallel samples, n > 1) waits
            # one round so it reuses the first copy's KV from the prefix cache instead of
            # computing the same prompt again in the same batch.
            admitted_prompts: set[tuple[int, ...]] = set()
            share = not self.args.disable_radix_cache
            for req in list(self.waiting_queue):
                if running + len(can_run) >= self.max_running_requests:
                    break
                key = tuple(req.origin_input_ids) if share and len(req.origin_input_ids) >= _SHARE_MIN_PROMPT else None
                if key is not None and key in admitted_prompts:
                    continue
                req.init_next_round_input(self.tree_cache)
                if req.extend_input_len > rem_input and can_run:
                    break
                if rem_chunk < max(page, 1):
                    break
                self.tree_cache.inc_lock_ref(req.last_node)
                cost = req.extend_input_len + self._reserve(req)
                nothing_else = not can_run and running == 0
                # Whole pages: a row's first and last pages may be partly empty.
                need = cost + (2 * page if page > 1 else 0)
                if need > rem_total() and not nothing_else:
                    self.tree_cache.dec_lock_ref(req.last_node)
                    break
                if req.retractions == 0 and not req.output_ids:
                    req.cached_tokens = len(req.prefix_indices)
                if take_chunk(req, min(rem_chunk, rem_input) if can_run else rem_chunk):
                    req.is_chunked = 1
                    new_chunked = req
                can_run.append(req)
                self.waiting_queue.remove(req)
                if key is not None:
                    admitted_prompts.add(key)
                admitted_cost += cost
                rem_input -= req.extend_input_len
                rem_chunk -= req.extend_input_len
                if new_chunked is not None:
                    break
        self.chunked_req = new_chunked
        if not can_run:
            return None
        batch = self._new_batch(can_run)
        if self._can_mix(can_run):
            # Decode rows ride along with the prefill chunk instead of waiting a step.
            batch.decoding_reqs = self.running_batch.reqs
            self.running_batch.reqs = []
        return batch

    def _can_mix(self, extend_reqs: list[Req]) -> bool:
        running = self.running_batch.reqs
        if not (self.args.enable_mixed_chunk and running and self.runner.attn_backend.supports_mixed):
            return False
        if any(r.return_logprob for r in running + extend_reqs):
            return False  # prompt-logprob rows need full logits; keep batches simple
        need = len(running) * max(1, self.args.page_size)
        return self.allocator.available_size() + self.tree_cache.evictable_size() >= need + sum(
            r.extend_input_len for r in extend_reqs)

    def _preempt_for_waiting(self) -> None:
        """Retracts running requests the policy names in favour of more urgent waiting ones."""
        if not self.policy_ctx.enable_preemption or not self.waiting_queue or not self.running_batch.reqs:
            return
        victims = self.policy.preempt(list(self.running_batch.reqs), list(self.waiting_queue), self.policy_ctx)
        victims = [v for v in victims if v in self.running_batch.reqs]
        if victims:
            self._retract(victims)
            self.running_batch.filter([r for r in self.running_batch.reqs if r not in victims])
            self.waiting_queue = self.policy.order(self.waiting_queue, self.policy_ctx)

    def _retract(self, reqs: list[Req]) -> None:
        """Frees (into the prefix cache) the KV of running requests and requeues them in front."""
        for req in reqs:
            self.tree_cache.cache_finished_req(req)
            req.reset_for_retract()
        self.num_retractions += len(reqs)
        self.waiting_queue = list(reqs) + self.waiting_queue

    # -- running -------------------------------------------------------------------
    def run_extend(self, batch: ScheduleBatch) -> bool:
        """Runs a prefill batch; False when its KV could not be allocated (requeued)."""
        want_logprob = any(r.return_logprob for r in batch.reqs)
        try:
            fb = batch.prepare_for_extend(return_logprob=want_logprob)
        except OutOfKVMemory:
            # Admission estimated memory that eviction could not deliver: requeue and retry later.
            self._requeue_failed_extend(batch)
            return False
        rows = batch.reqs + batch.decoding_reqs
        fb.sampling_info = SamplingBatchInfo.from_reqs(rows, self.runner.vocab_size, self.device, self.eos_token_ids)
        logits = self.runner.forward(fb)
        sample = self.runner.sample(logits, fb)
        self.forward_steps += 1
        ids = sample.next_token_ids.tolist()
        finished_or_streamed: list[Req] = []
        num_extend = len(batch.reqs)
        for i, req in enumerate(batch.decoding_reqs, start=num_extend):
            req.output_ids.append(ids[i])
            record_output_logprobs(req, i, sample)
            req.check_finished()
            if req.finished():
                self.tree_cache.cache_finished_req(req)
            else:
                self.running_batch.reqs.append(req)
            finished_or_streamed.append(req)
        for i, req in enumerate(batch.reqs):
            if req.wants_prompt_logprobs():
                record_prompt_logprobs(req, i, fb, logits)
            if req.is_chunked > 0:
                self.tree_cache.cache_unfinished_req(req)
                continue
            req.output_ids.append(ids[i])
            record_output_logprobs(req, i, sample)
            req.check_finished()
            if req.finished():
                self.tree_cache.cache_finished_req(req)
            else:
                self.tree_cache.cache_unfinished_req(req)
                self.running_batch.reqs.append(req)
            finished_or_streamed.append(req)
        self._emit(finished_or_streamed)
        return True

    def _requeue_failed_extend(self, batch: ScheduleBatch) -> None:
        self.running_batch.reqs = batch.decoding_reqs + self.running_batch.reqs
        batch.decoding_reqs = []
        for req in batch.reqs:
            if req is self.chunked_req or req.is_chunked:
                continue
            self.tree_cache.dec_lock_ref(req.last_node)
            if req.req_pool_idx is not None:
                self.req_to_token_pool.free(req.req_pool_idx)
            req.reset_for_retract()
            req.retractions -= 1
            self.waiting_queue.insert(0, req)

    def run_decode(self) -> None:
        """One decode step; with overlap, launches step N+1 before processing step N."""
        if self.enable_overlap:
            self._run_decode_overlap()
            return
        batch = self.running_batch
        self._ensure_decode_memory(batch)
        if batch.reqs:
            self._process_decode(self._launch_decode(batch, None, lag=0))
            batch.filter()

    def _launch_decode(self, batch: ScheduleBatch, input_ids: Any, lag: int,
                       info: SamplingBatchInfo | None = None) -> InflightDecode:
        """Prepares and launches a decode step; ``lag`` = tokens sampled but not yet appended."""
        fb = batch.prepare_for_decode(lag=lag, input_ids=input_ids)
        if info is None:
            info = self._decode_sampling_info(batch)
        info.steps = [len(r.output_ids) + lag for r in batch.reqs]
        fb.sampling_info = info
        sample = self.runner.sample(self.runner.forward(fb), fb)
        if info.penalizer is not None:
            info.penalizer.cumulate_output_tokens(sample.next_token_ids)
        self.forward_steps += 1
        for req in batch.reqs:
            req.inflight_steps += 1
        step = InflightDecode(list(batch.reqs), sample, info)
        ids = sample.next_token_ids
        if ids.is_cuda:
            step.host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            step.host_ids.copy_(ids, non_blocking=True)
            step.ready = torch.cuda.Event()
            step.ready.record()
        return step

    def _process_decode(self, step: InflightDecode) -> None:
        """Appends a launched step's tokens (waits for the device) and finishes requests."""
        ids = step.token_ids()
        live: list[Req] = []
        for i, req in enumerate(step.reqs):
            req.inflight_steps -= 1
            if req.finished():
                continue  # finished (or aborted) after this step was launched
            req.output_ids.append(ids[i])
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

    # -- output ---------------------------------------------------------------------
    def _emit(self, reqs: list[Req]) -> None:
        """Queues new tokens of ``reqs`` for the detokenizer (streaming ones every interval)."""
        send = [r for r in reqs if r.finished() or (
            r.stream and len(r.output_ids) - r.send_offset >= self.args.stream_interval)]
        if not send:
            return
        out = BatchTokenIDOut(
            rids=[], new_token_ids=[], finished_reasons=[], prompt_tokens=[], completion_tokens=[],
            cached_tokens=[], skip_special_tokens=[], spaces_between_special_tokens=[],
            stop_strings=[], no_stop_trim=[], output_token_logprobs=[], output_top_logprobs=[],
            input_token_logprobs=[], input_top_logprobs=[], prompt_tail_ids=[])
        for req in send:
            p = req.sampling_params
            start = req.send_offset
            out.rids.append(req.rid)
            out.new_token_ids.append(req.output_ids[start:])
            out.prompt_tail_ids.append(req.origin_input_ids[-16:] if start == 0 else None)
            out.finished_reasons.append(req.finished_reason.to_json() if req.finished_reason else None)
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.completion_tokens.append(len(req.output_ids))
            out.cached_tokens.append(req.cached_tokens)
            out.skip_special_tokens.append(p.skip_special_tokens)
            out.spaces_between_special_tokens.append(p.spaces_between_special_tokens)
            out.stop_strings.append(p.stop)
            out.no_stop_trim.append(p.no_stop_trim)
            if req.return_logprob:
                out.output_token_logprobs.append(req.output_token_logprobs[start:])
                out.output_top_logprobs.append(req.output_top_logprobs[start:])
                if not req.input_logprobs_sent and req.input_token_logprobs is not None and not req.is_chunked:
                    out.input_token_logprobs.append(req.input_token_logprobs)
                    out.input_top_logprobs.append(req.input_top_logprobs)
                    req.input_logprobs_sent = True
                else:
                    out.input_token_logprobs.append(None)
                    out.input_top_logprobs.append(None)
            else:
                out.output_token_logprobs.append(None)
                out.output_top_logprobs.append(None)
                out.input_token_logprobs.append(None)
                out.input_top_logprobs.append(None)
            req.send_offset = len(req.output_ids)
            if req.finished_reason is not None:
                self.reqs.pop(req.rid, None)
        self.outbox.append(out)

    # -- introspection ----------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused while requests are running."""
        if self.has_work():
            return False
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return True

    def stats(self) -> dict[str, Any]:
        total = self.runner.max_total_num_tokens
        free = self.allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        return {
            "max_total_num_tokens": total,
            "kv_free_tokens": free,
            "kv_evictable_tokens": evictable,
            "kv_used_tokens": total - free - evictable,
            "kv_usage": (total - free - evictable) / total,
            "num_running_reqs": len(self.running_batch.reqs) + (1 if self.chunked_req else 0),
            "num_waiting_reqs": len(self.waiting_queue),
            "num_retractions": self.num_retractions,
            "forward_steps": self.forward_steps,
        }


def check_no_leak(scheduler: Scheduler) -> None:
    """Asserts that every KV slot is free or held by the cache (call when idle)."""
    s = scheduler.stats()
    held = scheduler.tree_cache.total_size() if hasattr(scheduler.tree_cache, "total_size") else 0
    assert s["kv_free_tokens"] + held == s["max_total_num_tokens"], s
    assert scheduler.tree_cache.protected_size() == 0, "locked prefix after all requests finished"
