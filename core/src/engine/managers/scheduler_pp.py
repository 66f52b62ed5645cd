"""The scheduler under pipeline parallelism: up to ``pp_size`` micro-batches in flight.

Every rank runs this scheduler on the same inputs (lockstep, as with tensor parallelism), so
every rank forms the same micro-batches in the same order. Each turn (``step``):

1. a new micro-batch is formed from requests in no other in-flight micro-batch: a prefill of
   waiting requests (the ordinary admission), else up to ``ceil(running / pp_size)`` running
   requests for one decode token each;
2. this rank runs its stage's layers of it (``ModelRunner.forward_micro_batch``): a stage other
   than the first receives the hidden states from the previous stage first, one other than the
   last sends its own on without waiting; the last stage samples and sends the ids to every
   other rank without waiting (``ModelRunner.share_sample``);
3. when ``pp_size`` micro-batches are in flight (or nothing new could start), the oldest is
   processed: its sampled ids are received and appended, requests finish, outputs are emitted.

So stage ``s`` runs micro-batch ``k`` while stage ``s + 1`` runs ``k - 1``, and the first stage
waits only for the micro-batch it launched ``pp_size - 1`` turns earlier (SGLang's PP event
loop, on the lockstep scheduler). A request is in at most one in-flight micro-batch: its next
token depends on the last. Aborts of requests in flight wait until their micro-batch is
processed; the next chunk of a chunked prefill waits for the previous chunk.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.layers.logits_processor import LogitsProcessorOutput
from engine.managers.schedule_batch import ScheduleBatch
from engine.managers.scheduler import Scheduler
from engine.managers.scheduler_decode import InflightDecode
from engine.managers.timeline import mark
from engine.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from engine.config import ServerArgs
    from engine.distributed import PendingSends
    from engine.model_executor.forward_batch import ForwardBatch
    from engine.model_executor.model_runner import PendingSample, StageLaunch

logger = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """A micro-batch launched on this rank's stage whose sampled ids are not processed yet."""

    # A prefill (its ScheduleBatch as admitted) or a decode step (a ScheduleBatch of its rows).
    is_extend: bool
    batch: ScheduleBatch
    forward_batch: ForwardBatch
    # Decode: the rows' sampling info (processing records penalties and grammar state from it).
    info: SamplingBatchInfo | None
    launch: StageLaunch
    sample: PendingSample


class PipelineScheduler(Scheduler):
    """``Scheduler`` whose steps keep up to ``pp_size`` micro-batches in the pipeline."""

    def __init__(self, args: ServerArgs, model_path: str, platform: Any | None = None) -> None:
        super().__init__(args, model_path, platform)
        self.pp_size = self.runner.placement.pp_size
        # The pipeline is the overlap: a rank never waits for the micro-batch it just launched.
        self.enable_overlap = False
        if args.enable_mixed_chunk:
            logger.info("pipeline parallelism: --enable-mixed-chunk has no effect (prefill and decode "
                        "run as separate micro-batches)")
        self.in_flight: deque[MicroBatch] = deque()
        # Sends not known to be complete; their tensors must live until then.
        self._sends: list[PendingSends] = []
        # Counters (/get_server_info): micro-batches launched, those launched while at least one
        # other was in flight, and the most in flight at once.
        self.pp_micro_batches = 0
        self.pp_overlapped_micro_batches = 0
        self.pp_max_in_flight = 0

    # -- the loop ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.in_flight) or super().has_work()

    def step(self) -> bool:
        """Launches one micro-batch if any can start, then processes the oldest in flight when
        the pipeline is full or nothing could start. False when there was nothing to do."""
        started = time.perf_counter()
        if self.pending_aborts:
            self._apply_aborts()
        if self.grammar_queue.waiting:
            self._admit_compiled_grammars()
        launched = self._launch_next()
        processed = False
        if self.in_flight and (len(self.in_flight) >= self.pp_size or launched is None):
            self._process_oldest()
            processed = True
        self._sends = [s for s in self._sends if not s.done()]
        elapsed = time.perf_counter() - started
        if launched == "extend":
            self.extend_time_s += elapsed
        elif launched == "decode" or processed:
            self.decode_time_s += elapsed
        return launched is not None or processed or bool(self.grammar_queue.waiting)

    def drain(self) -> None:
        """Processes every micro-batch in flight (oldest first)."""
        while self.in_flight:
            self._process_oldest()

    def _busy(self) -> set[str]:
        return {r.rid for mb in self.in_flight for r in mb.batch.reqs}

    def _apply_aborts(self) -> None:
        # A request in flight is aborted once its micro-batch is processed (its KV is being
        # written and its token is on its way); the others now.
        busy = self._busy()
        deferred = {rid: msg for rid, msg in self.pending_aborts.items() if rid in busy}
        for rid in deferred:
            del self.pending_aborts[rid]
        super()._apply_aborts()
        self.pending_aborts.update(deferred)

    def _can_mix(self, extend_reqs: list[Any]) -> bool:
        return False

    # -- launching -----------------------------------------------------------------------
    def _launch_next(self) -> str | None:
        """Launches a prefill or decode micro-batch; its kind, or None when none could start."""
        if self.in_flight and self.waiting_queue and self.policy_ctx.enable_preemption:
            # Preemption retracts running requests: let none be in flight.
            self.drain()
        busy = self._busy()
        if (self.waiting_queue or self.chunked_req is not None) and not (
                self.chunked_req is not None and self.chunked_req.rid in busy):
            batch = self._admit()
            if batch is not None:
                fb = self._prepare_extend(batch)
                if fb is not None:
                    self.extend_tokens += sum(r.extend_input_len for r in batch.reqs)
                    for req in batch.reqs:  # the live view's and tracing's stages
                        mark(req, "prefill_chunk", req.extend_input_len)
                    self._launch(True, batch, fb, None)
                    return "extend"
        return "decode" if self._launch_decode_micro_batch(busy) else None

    def _admit(self) -> ScheduleBatch | None:
        """The ordinary admission, counting requests whose prefill is in flight as running
        (they hold a request slot and will reserve decode tokens like the running ones)."""
        joining = [r for mb in self.in_flight if mb.is_extend for r in mb.batch.reqs
                   if r.is_chunked == 0 and r.sampling_params.max_new_tokens > 0]
        if not joining:
            return self.get_new_batch_prefill()
        running = self.running_batch.reqs
        self.running_batch.reqs = running + joining
        try:
            return self.get_new_batch_prefill()
        finally:
            # Mixing is off and preemption drained the pipeline, so admission did not change
            # the running list.
            self.running_batch.reqs = running

    def _launch_decode_micro_batch(self, busy: set[str]) -> bool:
        """One decode token for up to ``ceil(running / pp_size)`` requests not in flight."""
        free = [r for r in self.running_batch.reqs if r.rid not in busy]
        if not free:
            return False
        sub = self._new_batch(free[:-(-len(self.running_batch.reqs) // self.pp_size)])
        room = self.allocator.available_size() + self.tree_cache.evictable_size()
        if room < sub.decode_tokens_needed():
            if self.in_flight:
                return False  # the micro-batches in flight may finish and free KV: process them first
            # Nothing in flight, so every running request is free: retract (or abort a lone
            # one) among all of them, as without pipeline parallelism.
            self._ensure_decode_memory(self.running_batch)
            if not self.running_batch.reqs:
                return False
            sub = self._new_batch(self.running_batch.reqs[:-(-len(self.running_batch.reqs) // self.pp_size)])
        fb = sub.prepare_for_decode()
        info = SamplingBatchInfo.from_reqs(sub.reqs, self.runner.vocab_size, self.device, self.eos_token_ids)
        fb.sampling_info = info
        for req in sub.reqs:  # the step holds a KV slot per row until processed
            req.inflight_steps += 1
        self.decode_steps += 1
        self.decode_rows += len(sub.reqs)
        self._launch(False, sub, fb, info)
        return True

    def _launch(self, is_extend: bool, batch: ScheduleBatch, fb: ForwardBatch,
                info: SamplingBatchInfo | None) -> None:
        launch = self.runner.forward_micro_batch(fb)
        if is_extend:
            self._set_extend_mask(batch, fb)
        else:
            assert info is not None
            self.grammar_queue.set_mask(info, batch.reqs)
        sample = self.runner.share_sample(launch, fb)
        self.forward_steps += 1
        self.pp_micro_batches += 1
        if self.in_flight:
            self.pp_overlapped_micro_batches += 1
        self.in_flight.append(MicroBatch(is_extend, batch, fb, info, launch, sample))
        self.pp_max_in_flight = max(self.pp_max_in_flight, len(self.in_flight))

    # -- processing ----------------------------------------------------------------------
    def _process_oldest(self) -> None:
        mb = self.in_flight.popleft()
        sample, full_logits = mb.sample.get()
        for sends in (mb.launch.sends, mb.sample.sends):
            if sends is not None:
                self._sends.append(sends)
        if mb.is_extend:
            logits = LogitsProcessorOutput(next_token_logits=None, full_logits=full_logits)  # type: ignore[arg-type]
            self._finish_extend(mb.batch, mb.forward_batch, logits, sample)
        else:
            assert mb.info is not None
            self._process_decode(InflightDecode(mb.batch.reqs, sample, mb.info))
            self.running_batch.filter()

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update({
            "pp_in_flight_micro_batches": len(self.in_flight),
            "pp_micro_batches": self.pp_micro_batches,
            "pp_overlapped_micro_batches": self.pp_overlapped_micro_batches,
            "pp_max_in_flight": self.pp_max_in_flight,
        })
        return out
