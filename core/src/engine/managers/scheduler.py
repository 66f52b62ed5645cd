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
import time
from typing import Any

from engine.config import ServerArgs
from engine.constrained.scheduling import GrammarQueue
from engine.disaggregation.scheduler_mixin import DisaggregationMixin
from engine.errors import ConfigError
from engine.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from engine.managers.kv_plan import KvPlan, tail_first_limit
from engine.managers.logprobs import record_output_logprobs, record_prompt_logprobs
from engine.managers.policy import PolicyContext
from engine.managers.schedule_batch import FinishReason, OutOfKVMemory, Req, ScheduleBatch
from engine.managers.scheduler_decode import DecodeMixin, InflightDecode
from engine.managers.scheduler_lora import LoraMixin
from engine.managers.scheduler_output import OutputMixin
from engine.managers.scheduler_pooling import PoolingMixin
from engine.managers.stop_strings import stop_string_check
from engine.managers.timeline import mark
from engine.model_executor.model_runner import ModelRunner
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Future decode tokens reserved per running request are clipped to this.
_RESERVE_CLIP = 4096
_INIT_NEW_TOKEN_RATIO = 0.7


def _tokens_left(req: Req, inflight: int = 0) -> int:
    """Tokens ``req`` may still generate (``inflight`` of them being sampled now), clipped to
    ``_RESERVE_CLIP``: the most KV slots admission sets aside for its future."""
    return min(max(req.sampling_params.max_new_tokens - len(req.output_ids) - inflight, 0), _RESERVE_CLIP)


# In-batch prefix sharing: requests with at least this many uncached tokens whose next
# _SHARE_PROBE tokens equal an admitted request's wait one round for the cache (n > 1, system prompts).
_SHARE_MIN_PROMPT = 8
_SHARE_PROBE = 32


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


class Scheduler(DecodeMixin, OutputMixin, PoolingMixin, LoraMixin, DisaggregationMixin):
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
        self.policy = self.runner.selection.create_policy()
        self.policy_ctx = PolicyContext(
            parent_of=lambda node: getattr(node, "parent", None),
            rng=random.Random(args.random_seed),
            enable_preemption=args.enable_priority_preemption)
        self.waiting_queue: list[Req] = []
        # Requests whose grammar compiles (structured output) wait here, not in the batch.
        self.grammar_queue = GrammarQueue(
            args.grammar_backend, None if args.skip_tokenizer_init else (args.tokenizer_path or model_path),
            self.runner.vocab_size, self.eos_token_ids, self.device, args.disable_plugin, args.plugin_options,
            args.trust_remote_code)
        self.running_batch = self._new_batch([])
        self.chunked_req: Req | None = None
        self.init_new_token_ratio = min(1.0, _INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness)
        self.new_token_ratio = self.init_new_token_ratio
        self.outbox: list[BatchTokenIDOut] = []
        # Overlap: the CPU launches decode step N+1 before processing step N's tokens.
        self.enable_overlap = (not args.disable_overlap_schedule
                               and self.runner.platform.supports_overlap_schedule())
        self.inflight: InflightDecode | None = None
        # Speculative decoding (--speculative-algorithm): decode steps verify drafts instead.
        self.speculator: Any = None
        if args.speculative_algorithm:
            from engine.speculative.worker import Speculator

            if self.runner.multimodal:
                raise ConfigError(f"--speculative-algorithm {args.speculative_algorithm}: not available for "
                                  f"vision-language models ({self.runner.hf_config.architectures[0]}); accepted: none")
            self.speculator = Speculator(self)
            if self.enable_overlap and self.speculator.wants_hidden:
                # Its proposer reads each target forward's hidden states in step order.
                logger.info("speculative decoding (%s): overlap scheduling off", self.speculator.algorithm)
                self.enable_overlap = False
            elif self.enable_overlap:
                logger.info("speculative decoding: verify steps run on the settled batch (a step's drafts need the "
                            "last one's tokens); decode steps of batches above --speculative-max-batch-size overlap")
        self.reqs: dict[str, Req] = {}
        self.pending_aborts: dict[str, str] = {}
        self._init_lora()  # loads the --lora-paths adapters
        self._init_disaggregation()  # --disaggregation-mode: the KV transfer backend
        # Counters for /get_server_info and metrics.
        self.num_retractions = 0
        self.forward_steps = 0
        self.decode_steps = 0
        self.overlapped_decode_steps = 0  # launched before the previous step's tokens were processed
        self.decode_rows = 0  # sum of decode batch sizes: / decode_steps = mean running batch
        self.extend_tokens = 0  # prompt tokens computed (re-prefill after retraction included)
        self.extend_time_s = 0.0  # wall time of prefill/mixed steps, device work included
        self.decode_time_s = 0.0  # wall time of decode steps

    def _create_cache(self) -> Any:
        from engine.mem_cache.chunk_cache import ChunkCache
        from engine.mem_cache.radix_cache import RadixCache

        # An encoder's states depend on the tokens after them: it writes no KV to share.
        if self.args.disable_radix_cache or not self.runner.uses_kv_cache:
            return ChunkCache(self.req_to_token_pool, self.allocator, self.args.page_size)
        if self.args.enable_hierarchical_cache:
            from engine.managers.scheduler_hicache import create_hierarchical_cache

            return create_hierarchical_cache(self.args, self.runner)
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
        error = (self._validate(req) or self._attach_lora(req, getattr(recv, "lora_name", None))
                 or self._disagg_attach(req, recv))
        if not error and (recv.mm_items or self.runner.mrope):
            error = self._attach_multimodal(req, recv.mm_items)
        if error:
            req.finished_reason = FinishReason("abort", message=error)
            self._emit([req])
            return
        # Leave room for at least the prompt and one token within the context.
        params.max_new_tokens = min(params.max_new_tokens, self.context_len - len(req.origin_input_ids))
        req.stop_check = stop_string_check(params, req.origin_input_ids, self.grammar_queue.tokenizer_path,
                                           self.args.trust_remote_code)
        if self.grammar_queue.submit(req):
            mark(req, "grammar")
        else:
            self.waiting_queue.append(req)

    def _admit_compiled_grammars(self) -> None:
        """Moves requests whose grammar compiled to the waiting queue; ends those whose compile
        failed. Waits briefly for a compile only when nothing else can run."""
        idle = not (self.waiting_queue or self.running_batch.reqs or self.chunked_req or self.inflight)
        ready, failed = self.grammar_queue.poll(wait_s=0.005 if idle else 0.0)
        for req in ready:
            mark(req, "queued")
        self.waiting_queue.extend(ready)
        for req, message in failed:
            req.finished_reason = FinishReason("abort", message=message)
        if failed:
            self._emit([req for req, _ in failed])

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

    def _attach_multimodal(self, req: Req, items: list[Any]) -> str | None:
        """Gives a request its images and video and, on M-RoPE models, its prompt's positions."""
        if items and not self.runner.multimodal:
            return (f"this model ({self.runner.hf_config.architectures[0]}) takes no images or video; "
                    "accepted: text only")
        req.mm_items = list(items)
        if self.runner.mrope:
            try:
                positions, delta = self.runner.model.mm_positions(req.origin_input_ids, req.mm_items)
            except ValueError as exc:  # items that do not fit the prompt: this request's error only
                return f"image/video items: {exc}"
            req.mrope_positions, req.mrope_delta = positions.long().cpu(), int(delta)
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
            self.runner.mm_cache.release(rid)
            self.grammar_queue.remove(req)  # still compiling: it is in no other queue
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
                    or self.pending_aborts or self.inflight or self.grammar_queue.waiting or self.disagg_busy())

    def step(self) -> bool:
        """Runs one batch; returns False when there was nothing to do."""
        if self.pending_aborts:
            self.drain()
            self._apply_aborts()
        self._disagg_step()  # decode mode: fetch and admit requests whose KV comes from a prefill server
        if self.lora_draining:
            self._reap_loras()
        if self.grammar_queue.waiting:
            self._admit_compiled_grammars()
        if self.chunked_req is not None or (self.waiting_queue and self._admission_needs_settled_batch()):
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
        return bool(self.grammar_queue.waiting)

    def _admission_needs_settled_batch(self) -> bool:
        """Whether admission must see the in-flight decode step's tokens appended first.

        Plain admission does not: the in-flight step already holds its KV slots, and its rows
        count as running with one token less generated, so the estimate only errs towards
        reserving more. Mixing decode rows into the prefill (their input is that step's
        token) and preemption (it retracts running rows) need the settled batch.
        """
        return bool(self.args.enable_mixed_chunk or self.policy_ctx.enable_preemption)

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
        """KV slots to set aside for a request's future tokens.

        Most requests may stop early (EOS, stop ids or strings), so they reserve
        ``new_token_ratio`` of what is left (SGLang's estimate). A request that cannot stop
        before ``max_new_tokens`` (``ignore_eos`` and no stop conditions) will use all of it:
        reserving less only admits requests that must later be retracted and recomputed.
        """
        left = _tokens_left(req)
        return left if req.runs_to_length else int(left * self.new_token_ratio)

    def _admission_plan(self) -> tuple[KvPlan | None, int]:
        """The running requests' claim on the pool: run-to-length ones in a ``KvPlan`` (their
        exact future; None with ``--disable-kv-plan``), the others' reserves summed."""
        plan = None if self.args.disable_kv_plan else KvPlan(self.args.page_size)
        reserved = 0
        for r in self.running_batch.reqs:
            if plan is not None and r.runs_to_length:
                # Slots: the prefilled tokens, then one per launched decode step (the last
                # sampled token has none yet); each token still to sample takes one more. The
                # cached prefix it was admitted with is not its own (``claim``).
                held = r.seqlen - 1 + r.inflight_steps - r.admitted_prefix_len
                plan.add(held, _tokens_left(r, r.inflight_steps), held)
            else:
                reserved += self._reserve(r)
        return plan, reserved

    def _tail_first_limit(self, plan: KvPlan, free: int) -> int | None:
        """How many waiting requests this round may admit (``kv_plan.tail_first_limit``; ``free``:
        slots free now beside the requests outside ``plan``); None: no limit (also when a waiting
        request may stop early: its length is a guess, and when request slots, not KV, bound how
        many run: --max-running-requests)."""
        waiting = self.waiting_queue
        if (len(waiting) < 2 or len(waiting) > self.max_running_requests - len(self.running_batch.reqs)
                or not all(r.runs_to_length for r in waiting)):
            return None
        bases = [r.seqlen for r in waiting]
        lefts = [_tokens_left(r) for r in waiting]
        # Each admission check keeps two pages spare (a row's partly empty first and last page):
        # a group that fits only without them would be admitted all but its last request.
        page = self.args.page_size
        free -= 2 * page if page > 1 else 0
        return tail_first_limit(plan, bases, lefts, free, free + plan.held)

    def _order_waiting(self) -> None:
        if self.policy.needs_prefix_match(len(self.waiting_queue)):
            for req in self.waiting_queue:
                # Retracted requests resume from prompt + output: match what admission will.
                tokens = req.origin_input_ids + req.output_ids
                match = self.tree_cache.prefix_hint(tokens[:-1], req.lora_uid)
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
        plan, reserved = self._admission_plan()
        admitted_cost = 0

        def rem_total() -> int:
            # Live: locking an admitted request's prefix makes it unevictable.
            return (self.allocator.available_size() + self.tree_cache.evictable_size()
                    - reserved - admitted_cost - (plan.need() if plan is not None else 0))

        def claim(req: Req, cost: int) -> None:
            """Counts an admitted request's claim on the pool: its slots in ``plan`` (those past
            the cached prefix it was admitted with: a prefix may be shared and outlive it), else ``cost``."""
            nonlocal admitted_cost
            if plan is not None and req.runs_to_length:
                own = len(req.prefix_indices) - req.admitted_prefix_len
                plan.add(req.seqlen - req.admitted_prefix_len, _tokens_left(req), own)
            else:
                admitted_cost += cost

        rem_input = self.args.max_prefill_tokens
        # Bidirectional (encoder) models see the whole prompt in one forward: no chunks.
        chunking = self.args.chunked_prefill_enabled and self.runner.uses_kv_cache
        rem_chunk = self.args.chunked_prefill_size if chunking else 1 << 62
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
            claim(req, req.extend_input_len + self._reserve(req))
            rem_input -= req.extend_input_len
            rem_chunk -= req.extend_input_len

        if new_chunked is None:
            # In-batch prefix sharing: a request whose next uncached tokens start like those of a
            # request admitted this round (same cached depth, same next _SHARE_PROBE tokens: a
            # shared system prompt, or parallel samples n > 1) waits one round, then finds that
            # prefix in the cache instead of computing it twice in one batch.
            admitted_prefixes: set[tuple[int | None, int, tuple[int, ...]]] = set()
            share = not self.args.disable_radix_cache
            limit = None if plan is None else self._tail_first_limit(plan, rem_total() + plan.need())
            for req in list(self.waiting_queue):
                if running + len(can_run) >= self.max_running_requests:
                    break
                if limit is not None and len(can_run) - (self.chunked_req is not None) >= limit:
                    break  # the rest start later, together (tail first)
                if req.lora_uid is not None and self._lora_blocks(req, self.running_batch.reqs + can_run):
                    continue  # its adapter would exceed --max-loras-per-batch: a later batch
                req.init_next_round_input(self.tree_cache)
                key = None
                if share and req.extend_input_len >= _SHARE_MIN_PROMPT:
                    depth = len(req.prefix_indices)
                    # Prefixes are shared within an adapter only (the radix cache's namespaces).
                    key = (req.lora_uid, depth, tuple(req.fill_ids[depth : depth + _SHARE_PROBE]))
                    if key in admitted_prefixes:
                        continue
                if req.extend_input_len > rem_input and can_run:
                    break
                if rem_chunk < max(page, 1):
                    break
                self.tree_cache.inc_lock_ref(req.last_node)
                if plan is not None and req.runs_to_length:
                    cost = plan.extra_need(req.seqlen - len(req.prefix_indices), _tokens_left(req), 0)
                else:
                    cost = req.extend_input_len + self._reserve(req)
                nothing_else = not can_run and running == 0
                # Whole pages: a row's first and last pages may be partly empty.
                need = cost + (2 * page if page > 1 else 0)
                if need > rem_total() and not nothing_else:
                    self.tree_cache.dec_lock_ref(req.last_node)
                    break
                if req.retractions == 0 and not req.output_ids:
                    req.cached_tokens = len(req.prefix_indices)
                self.tree_cache.note_admitted()
                req.admitted_prefix_len = len(req.prefix_indices)
                if take_chunk(req, min(rem_chunk, rem_input) if can_run else rem_chunk):
                    req.is_chunked = 1
                    new_chunked = req
                can_run.append(req)
                self.waiting_queue.remove(req)
                mark(req, "scheduled")
                if key is not None:
                    admitted_prefixes.add(key)
                claim(req, cost)
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
            self.runner.mm_cache.release(req.rid)
            req.reset_for_retract()
            mark(req, "retracted")
            if self.speculator is not None:
                self.speculator.request_retracted(req)
        self.num_retractions += len(reqs)
        self.waiting_queue = list(reqs) + self.waiting_queue

    # -- running -------------------------------------------------------------------
    def run_extend(self, batch: ScheduleBatch) -> bool:
        """Runs a prefill batch; False when its KV could not be allocated (requeued)."""
        if batch.reqs[0].pool_state is not None:  # a pooling server's batches hold only pooling requests
            return self.run_pooling(batch)
        started = time.perf_counter()
        fb = self._prepare_extend(batch)
        if fb is None:
            return False
        for req in batch.reqs:
            mark(req, "prefill_chunk", req.extend_input_len, started)
        logits = self.runner.forward(fb)
        if self.speculator is not None:
            self.speculator.hand_hidden_states(batch.reqs + batch.decoding_reqs, fb, logits)
        self._set_extend_mask(batch, fb)
        sample = self.runner.sample(logits, fb)
        self.forward_steps += 1
        self.extend_tokens += sum(r.extend_input_len for r in batch.reqs)
        staged = self._disagg_stage(batch)  # prefill mode: host copies of prompts' KV to hand over
        self._finish_extend(batch, fb, logits, sample)
        # After the sampled ids reached the host: the forward's device work is in the time (it was
        # counted in the next decode step's before).
        self.extend_time_s += time.perf_counter() - started
        self._disagg_publish(staged)
        return True

    def _prepare_extend(self, batch: ScheduleBatch) -> Any:
        """The prefill batch's ForwardBatch with its sampling info; None when its KV could not
        be allocated (the batch is requeued)."""
        want_logprob = any(r.return_logprob for r in batch.reqs)
        try:
            fb = batch.prepare_for_extend(return_logprob=want_logprob)
        except OutOfKVMemory:
            # Admission estimated memory that eviction could not deliver: requeue and retry later.
            self._requeue_failed_extend(batch)
            return None
        self.tree_cache.ready_for_forward()  # prefixes loaded back from a KV tier come first
        rows = batch.reqs + batch.decoding_reqs
        fb.sampling_info = SamplingBatchInfo.from_reqs(rows, self.runner.vocab_size, self.device, self.eos_token_ids)
        return fb

    @staticmethod
    def _extend_rows_keep_token(batch: ScheduleBatch) -> list[bool]:
        """Per row of a prefill batch (extend rows, then decode rows): whether its sampled token
        is appended: the last (or only) chunk of a prompt that wants output, and decode rows."""
        keep = [r.is_chunked == 0 and r.sampling_params.max_new_tokens > 0 for r in batch.reqs]
        return keep + [True] * len(batch.decoding_reqs)

    def _set_extend_mask(self, batch: ScheduleBatch, fb: Any) -> None:
        self.grammar_queue.set_mask(fb.sampling_info, batch.reqs + batch.decoding_reqs,
                                    self._extend_rows_keep_token(batch))

    def _finish_extend(self, batch: ScheduleBatch, fb: Any, logits: Any, sample: Any) -> None:
        """Appends a prefill batch's sampled tokens, records logprobs, finishes and emits rows."""
        ids = sample.next_token_ids.tolist()
        # Constrained rows' matchers take their tokens in one batch call before the appends.
        accepted = self.grammar_queue.accept_tokens(batch.reqs + batch.decoding_reqs, ids,
                                                    self._extend_rows_keep_token(batch))
        finished_or_streamed: list[Req] = []
        num_extend = len(batch.reqs)
        for i, req in enumerate(batch.decoding_reqs, start=num_extend):
            req.append_output(ids[i], accepted[i])
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
            if req.mm_items:
                self.runner.mm_cache.release(req.rid)  # its prefill is done
            if req.sampling_params.max_new_tokens == 0:
                # Prompt only (scoring, prefix warm-up): the sampled token is not part of the
                # answer, as in SGLang; its prompt logprobs were recorded above.
                req.finished_reason = FinishReason("length", length=0)
                self.tree_cache.cache_finished_req(req)
                finished_or_streamed.append(req)
                continue
            req.append_output(ids[i], accepted[i])
            if len(req.output_ids) == 1:
                mark(req, "first_token", 1)
            record_output_logprobs(req, i, sample)
            req.check_finished()
            if req.finished():
                self.tree_cache.cache_finished_req(req)
            else:
                self.tree_cache.cache_unfinished_req(req)
                self.running_batch.reqs.append(req)
            finished_or_streamed.append(req)
        self._emit(finished_or_streamed)

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


def check_no_leak(scheduler: Scheduler) -> None:
    """Asserts that every KV slot is free or held by the cache (call when idle)."""
    s = scheduler.stats()
    held = scheduler.tree_cache.total_size() if hasattr(scheduler.tree_cache, "total_size") else 0
    assert s["kv_free_tokens"] + held == s["max_total_num_tokens"], s
    assert scheduler.tree_cache.protected_size() == 0, "locked prefix after all requests finished"
