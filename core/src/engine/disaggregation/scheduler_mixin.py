"""The scheduler's half of prefill/decode disaggregation (``--disaggregation-mode``).

Prefill mode: a request carrying a ``bootstrap_room`` runs its prompt and samples its first
token (its ``max_new_tokens`` is capped at 1); right after that prefill its prompt's KV is
copied to host memory and published to the transfer backend, and the request ends as usual
(its KV stays in the prefix cache like any finished request's).

Decode mode: such a request leaves the waiting queue for ``disagg_waiting`` while its KV is
fetched from the prefill server. When the payload arrives, the request gets a request slot
and KV slots for its prompt, the payload is written into the pool, and the request joins the
running batch with the prefill server's first token appended, exactly as after a local
prefill. A fetch that fails (time-out, layout mismatch, dead peer) ends the request with the
reason; an aborted request's fetch is cancelled (nothing was allocated for it yet).

Requests without a room run locally on either kind of server.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from engine.disaggregation.stage import HostCopy, KvStager
from engine.disaggregation.transfer import HOST_POOL_BYTES, KvLayout, KvPayload, KvTransferContext, transfer_key
from engine.disaggregation.upload import KvUploader
from engine.managers.schedule_batch import FinishReason, OutOfKVMemory
from engine.managers.timeline import mark

if TYPE_CHECKING:
    from engine.managers.io_struct import TokenizedGenerateReqInput
    from engine.managers.schedule_batch import Req, ScheduleBatch

logger = logging.getLogger(__name__)

# How long an idle decode server waits on the transfer backend per step (keeps the loop from
# spinning while only fetches are outstanding).
_IDLE_WAIT_S = 0.002
# Per-request transfer records kept for /get_server_info (``disaggregation.recent``).
_RECENT = 64


def kv_layout_of(runner: Any, args: Any) -> KvLayout:
    pool = runner.token_to_kv_pool
    return KvLayout(num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
                    v_head_dim=pool.v_head_dim, dtype=str(pool.dtype), tp_size=args.tp_size,
                    page_size=args.page_size, kv_layout=getattr(pool, "kv_layout", "mha"))


def _pairs(rows: list[Any] | None) -> list[tuple[Any, ...]] | None:
    return None if rows is None else [tuple(r) for r in rows]


def _take_logprobs(req: Req, sent: dict[str, Any]) -> None:
    """The prefill server's logprobs of the first token (and of the prompt), as if computed here
    (they crossed as JSON: pairs come back as tuples)."""
    req.output_token_logprobs = _pairs(sent.get("output_token_logprobs")) or []
    req.output_top_logprobs = [_pairs(row) or [] for row in sent.get("output_top_logprobs") or []]
    req.input_token_logprobs = _pairs(sent.get("input_token_logprobs"))
    if sent.get("input_top_logprobs") is not None:
        req.input_top_logprobs = [_pairs(row) or [] for row in sent["input_top_logprobs"]]


class DisaggregationMixin:
    """Mixed into ``Scheduler``: ``_init_disaggregation`` at start, ``_disagg_attach`` per new
    request, ``_disagg_step`` at the top of every step, ``_disagg_stage``/``_disagg_publish``
    around a prefill batch's finish."""

    args: Any
    runner: Any
    # Class defaults: a scheduler built without ``_init_disaggregation`` (tests' stand-ins) is a whole server.
    kv_transfer: Any = None
    disagg_uploader: KvUploader | None = None
    disagg_stager: KvStager | None = None
    disagg_mode = "null"
    _disagg_stage_s = 0.0  # the last prefill batch's staging seconds (``_disagg_stage`` sets it)

    def _init_disaggregation(self) -> None:
        self.disagg_mode = self.args.disaggregation_mode
        self.kv_transfer: Any = None
        self.disagg_waiting: dict[str, Req] = {}  # decode: key -> request whose KV is on its way
        self.disagg_arrived: list[tuple[Req, KvPayload]] = []  # decode: KV on the device, waiting for slots
        # Decode: payloads written into the pool, kept (their device copies) until the write's event passed.
        self._disagg_writing: list[tuple[Any, KvPayload]] = []
        self.disagg_counts = {"requests": 0, "transferred": 0, "failed": 0, "transfer_bytes": 0,
                              "transfer_wait_s": 0.0}
        # The newest requests' transfers: bytes and seconds on this side (``_disagg_stats``).
        self.disagg_recent: deque[dict[str, Any]] = deque(maxlen=_RECENT)
        if self.disagg_mode == "null":
            return
        import engine.plugins as plugins

        args = self.args
        ctx = KvTransferContext(
            role=self.disagg_mode, layout=kv_layout_of(self.runner, args), host=args.host,
            port=args.disaggregation_bootstrap_port if self.disagg_mode == "prefill" else 0,
            timeout_s=args.disaggregation_timeout_s, device=str(self.runner.device),
            backend=args.disaggregation_transfer_backend)
        self.kv_transfer = plugins.create_kv_transfer_backend(
            args.disaggregation_transfer_backend, ctx, torch.device(self.runner.device).type,
            args.disable_plugin, args.plugin_options)
        if self.disagg_mode == "decode":
            self.disagg_uploader = KvUploader(self.runner.platform, torch.device(self.runner.device))
        elif self._disagg_pins():
            # Host payloads of a device pool: copied out on a copy stream, published by a thread,
            # into a pinned pool taken now (the backend may size it: ``host_pool_bytes``).
            asked = getattr(self.kv_transfer, "host_pool_bytes", None)
            self.disagg_stager = KvStager(self.runner.platform, torch.device(self.runner.device),
                                          self.kv_transfer.publish, pool_bytes=HOST_POOL_BYTES if asked is None else asked)
        where = f" on {args.host}:{getattr(self.kv_transfer, 'port', ctx.port)}" if self.disagg_mode == "prefill" else ""
        if self.disagg_stager is not None:
            where += f", pinned pool {self.disagg_stager.stats()['pool_bytes'] / (1 << 30):.2f} GiB"
        logger.info("disaggregation: %s server, KV transfer '%s'%s", self.disagg_mode,
                    args.disaggregation_transfer_backend, where)

    # -- arrival -------------------------------------------------------------------------
    def _disagg_attach(self, req: Req, recv: TokenizedGenerateReqInput) -> str | None:
        """Marks a disaggregated request (an error message when it cannot be one)."""
        room = getattr(recv, "bootstrap_room", None)
        if room is None or self.kv_transfer is None or req.sampling_params.max_new_tokens == 0:
            return None  # runs here as on a whole server
        if recv.mm_items:
            return "images and video are not supported with --disaggregation-mode; send text prompts"
        req.disagg_key = transfer_key(room, req.rid)  # type: ignore[attr-defined]
        req.disagg_source = (recv.bootstrap_host, recv.bootstrap_port)  # type: ignore[attr-defined]
        self.disagg_counts["requests"] += 1
        if self.disagg_mode == "prefill":
            req.sampling_params.max_new_tokens = 1  # the decode server generates the rest
        else:
            # On the request, not in a table: one aborted before its fetch leaves nothing behind.
            req.disagg_since = time.monotonic()  # type: ignore[attr-defined]
        return None

    # -- decode: fetch, receive, admit -----------------------------------------------------
    def _disagg_step(self) -> None:
        if self.kv_transfer is None or self.disagg_mode != "decode":
            return
        queue: list[Req] = self.waiting_queue  # type: ignore[attr-defined]
        fetching = [r for r in queue if getattr(r, "disagg_key", None) and not getattr(r, "disagg_done", False)]
        for req in fetching:
            queue.remove(req)
            self.disagg_waiting[req.disagg_key] = req  # type: ignore[attr-defined]
            host, port = req.disagg_source  # type: ignore[attr-defined]
            left = self.args.disaggregation_timeout_s - (time.monotonic() - req.disagg_since)  # type: ignore[attr-defined]
            self.kv_transfer.fetch(req.disagg_key, host, port, max(left, 0.0))  # type: ignore[attr-defined]
            # Its prefill runs elsewhere from here: queue and prefill phases (metrics, tracing) split here.
            mark(req, "scheduled")
            mark(req, "kv_fetch", len(req.origin_input_ids))
        for key, req in list(self.disagg_waiting.items()):
            if req.finished():  # aborted while its KV was on the way
                del self.disagg_waiting[key]
                self.kv_transfer.cancel(key)
        self._disagg_reap()
        uploader = self.disagg_uploader
        assert uploader is not None
        self.disagg_arrived = self._disagg_live(self.disagg_arrived)
        idle = not (queue or self.running_batch.reqs or self.disagg_arrived)  # type: ignore[attr-defined]
        wait = _IDLE_WAIT_S if idle and self.disagg_waiting else 0.0
        failed: list[Req] = []
        for key, result in self.kv_transfer.poll(wait) if self.disagg_waiting else []:
            req = self.disagg_waiting.pop(key, None)
            if req is None:
                continue
            if isinstance(result, str):
                failed.append(self._disagg_fail(req, f"KV transfer failed: {result}"))
            elif result.num_tokens != len(req.origin_input_ids):
                failed.append(self._disagg_fail(req, f"KV transfer failed: the prefill server sent KV for "
                                                     f"{result.num_tokens} tokens, the prompt has {len(req.origin_input_ids)}"))
            else:
                waited = time.monotonic() - req.disagg_since  # type: ignore[attr-defined]
                self.disagg_counts["transferred"] += 1
                self.disagg_counts["transfer_bytes"] += result.nbytes
                self.disagg_counts["transfer_wait_s"] += waited
                mark(req, "kv_arrived", result.num_tokens)
                result.meta["wait_s"] = waited
                uploader.submit(req, result)  # to the device off this thread
        if failed:
            self._emit(failed)  # type: ignore[attr-defined]
        upload_wait = _IDLE_WAIT_S if idle and not self.disagg_waiting and uploader.busy() else 0.0
        self.disagg_arrived += self._disagg_live(uploader.done(upload_wait))
        if self.disagg_arrived:
            self._disagg_admit()

    def _disagg_live(self, arrived: list[tuple[Req, KvPayload]]) -> list[tuple[Req, KvPayload]]:
        """``arrived`` without requests aborted meanwhile (their uploaded KV is let go)."""
        live = [(r, p) for r, p in arrived if not r.finished()]
        if len(live) < len(arrived) and self.disagg_uploader is not None:
            self.disagg_uploader.release(len(arrived) - len(live))
        return live

    def _disagg_reap(self) -> None:
        """Lets go of written payloads whose write the device has finished."""
        if not self._disagg_writing:
            return
        left = [(e, p) for e, p in self._disagg_writing if not e.query()]
        if self.disagg_uploader is not None:
            self.disagg_uploader.release(len(self._disagg_writing) - len(left))
        self._disagg_writing = left

    def _disagg_fail(self, req: Req, message: str) -> Req:
        self.disagg_counts["failed"] += 1
        req.finished_reason = FinishReason("abort", message=message)
        return req

    def _disagg_admit(self) -> None:
        """Writes arrived KV into the pool and starts decoding those requests (as many as fit)."""
        self.drain()  # type: ignore[attr-defined]  # the in-flight decode step first (overlap)
        running = self.running_batch  # type: ignore[attr-defined]
        pool = self.runner.token_to_kv_pool
        done: list[Req] = []
        left: list[tuple[Req, KvPayload]] = []
        for req, payload in self.disagg_arrived:
            if left or len(running.reqs) + len(done) >= self.max_running_requests:  # type: ignore[attr-defined]
                left.append((req, payload))
                continue
            req.init_next_round_input(None)
            match = self.tree_cache.match_prefix([])  # type: ignore[attr-defined]
            req.prefix_indices, req.last_node = match.device_indices, match.last_node
            self.tree_cache.inc_lock_ref(req.last_node)  # type: ignore[attr-defined]
            batch: ScheduleBatch = self._new_batch([req])  # type: ignore[attr-defined]
            n = len(req.origin_input_ids)
            try:
                batch._alloc_req_slots([req])
                slots = batch._alloc_tokens([0], [n], [-1])
            except OutOfKVMemory:
                self.tree_cache.dec_lock_ref(req.last_node)  # type: ignore[attr-defined]
                if req.req_pool_idx is not None:
                    self.req_to_token_pool.free(req.req_pool_idx)  # type: ignore[attr-defined]
                req.req_pool_idx = None
                left.append((req, payload))  # running requests hold the pool: retry after they finish
                continue
            self.req_to_token_pool.write(req.req_pool_idx, 0, slots)  # type: ignore[attr-defined]
            write_s = self._disagg_write(pool, slots, payload)
            req.disagg_done = True  # type: ignore[attr-defined]  # a retraction later recomputes locally
            if req.return_logprob:
                _take_logprobs(req, payload.meta.get("logprobs") or {})
            req.append_output(payload.first_token)
            # The decode server's first token is the prefill server's, handed over now: its TTFT
            # (metrics, live view, tracing) counts from here.
            mark(req, "first_token", 1)
            self.disagg_recent.append({
                "rid": req.rid, "tokens": n, "bytes": payload.nbytes, "wait_s": round(payload.meta.get("wait_s", 0.0), 6),
                "transfer_s": _rounded(payload.meta.get("transfer_s")), "upload_s": _rounded(payload.meta.get("upload_s")),
                "write_s": round(write_s, 6)})
            req.check_finished()
            if req.finished():
                self.tree_cache.cache_finished_req(req)  # type: ignore[attr-defined]
            else:
                self.tree_cache.cache_unfinished_req(req)  # type: ignore[attr-defined]
                running.reqs.append(req)
            done.append(req)
        self.disagg_arrived = left
        if done:
            self._emit(done)  # type: ignore[attr-defined]

    def _disagg_write(self, pool: Any, slots: torch.Tensor, payload: KvPayload) -> float:
        """Scatters a payload's KV (on the pool's device already: ``KvUploader``) into the pool
        at ``slots``, one copy per layer, queued behind the decode steps without waiting for
        the device. Returns the seconds this thread spent on it (on the CPU, the copy's)."""
        started = time.perf_counter()
        device = pool.k_buffer[0].device
        index = slots.to(device, non_blocking=True)
        k = payload.k.to(device)
        mla = getattr(pool, "kv_layout", "mha") == "mla"  # MLA's V is a view of its K rows
        v = None if mla else payload.v.to(device)
        for layer in range(pool.num_layers):
            pool.k_buffer[layer][index] = k[layer]
            if v is not None:
                pool.v_buffer[layer][index] = v[layer]
        event = self.runner.platform.create_event() if device.type != "cpu" else None
        if event is None:
            if self.disagg_uploader is not None:
                self.disagg_uploader.release()
        else:
            event.record()  # the payload's device copy stays allocated until the scatter ran
            self._disagg_writing.append((event, payload))
        return time.perf_counter() - started

    # -- prefill: stage and publish ------------------------------------------------------
    def _disagg_pins(self) -> bool:
        """Whether published payloads go to pinned host memory through ``KvStager`` (a device
        pool whose backend takes host tensors)."""
        where = getattr(self.kv_transfer, "payload_device", "cpu")
        return where == "cpu" and torch.device(self.runner.device).type != "cpu" and self.runner.platform.pin_host_memory()

    def _disagg_stage(self, batch: ScheduleBatch) -> list[tuple[Req, Any, Any]]:
        """The prompt KV of the batch's disaggregated rows whose prefill ends now, gathered out of
        the pool before the finish hands their slots to the prefix cache: ``(req, k, v)``, or
        ``(req, HostCopy, None)`` where the stager copies it to pinned host memory."""
        if self.kv_transfer is None or self.disagg_mode != "prefill":
            return []
        pool = self.runner.token_to_kv_pool
        r2t = self.req_to_token_pool.req_to_token  # type: ignore[attr-defined]
        # Host memory unless the backend moves device tensors itself (NCCL, CUDA IPC).
        where = getattr(self.kv_transfer, "payload_device", "cpu")
        stager = self.disagg_stager
        mla = getattr(pool, "kv_layout", "mha") == "mla"
        staged: list[tuple[Req, Any, Any]] = []
        started = time.perf_counter()
        for req in batch.reqs:
            if getattr(req, "disagg_key", None) is None or req.is_chunked:
                continue
            index = r2t[req.req_pool_idx, : len(req.origin_input_ids)].to(torch.int64)
            # On the pool's device and its current stream: a later batch that reuses the slots
            # is queued after this gather.
            k = _gather(pool.k_buffer, index)
            v = k.new_empty((*k.shape[:3], 0)) if mla else _gather(pool.v_buffer, index)
            if stager is not None:
                staged.append((req, stager.gathered(k, v), None))
            else:
                staged.append((req, k.to(where), v.to(where)))
        self._disagg_stage_s = time.perf_counter() - started
        return staged

    def _disagg_publish(self, staged: list[tuple[Req, Any, Any]]) -> None:
        # The batch's staging time, shared by its rows in proportion to their bytes.
        sizes = [k.nbytes if isinstance(k, HostCopy) else k.nbytes + v.nbytes for _, k, v in staged]
        total = sum(sizes)
        for (req, k, v), nbytes in zip(staged, sizes, strict=True):
            if not req.output_ids or (req.finished_reason is not None and req.finished_reason.kind == "abort"):
                continue  # nothing to continue from: the decode server's fetch fails by its deadline
            meta: dict[str, Any] = {"prompt_tokens": len(req.origin_input_ids)}
            if req.return_logprob:  # the first token's, and the prompt's when asked: computed here only
                meta["logprobs"] = {"output_token_logprobs": req.output_token_logprobs[:1],
                                    "output_top_logprobs": req.output_top_logprobs[:1],
                                    "input_token_logprobs": req.input_token_logprobs,
                                    "input_top_logprobs": req.input_top_logprobs}
            copy = k if isinstance(k, HostCopy) else None
            if copy is not None:
                k, v = copy.sources  # on the device: the stager publishes its host copy
            payload = KvPayload(req.output_ids[0], k, v, meta)
            self.disagg_counts["transferred"] += 1
            self.disagg_counts["transfer_bytes"] += nbytes
            record: dict[str, Any] = {"rid": req.rid, "tokens": payload.num_tokens, "bytes": nbytes,
                                      "stage_s": round(self._disagg_stage_s * nbytes / max(total, 1), 6),
                                      "copy_s": None}
            self.disagg_recent.append(record)
            if copy is None:
                self.kv_transfer.publish(req.disagg_key, payload)  # type: ignore[attr-defined]
            else:  # only the stager makes a HostCopy: never the device staging to a host backend
                assert self.disagg_stager is not None
                self.disagg_stager.publish_after(copy, req.disagg_key, payload, record)  # type: ignore[attr-defined]

    # -- bookkeeping ---------------------------------------------------------------------
    def disagg_busy(self) -> bool:
        """Whether the loop must keep stepping for disaggregation: fetches, arrivals, uploads,
        and written payloads whose device copies wait for their write's event (``_disagg_reap``
        releases them; an idle loop that stopped stepping would keep them)."""
        if self.kv_transfer is None:
            return False
        uploading = self.disagg_uploader is not None and self.disagg_uploader.busy()
        return bool(self.disagg_waiting or self.disagg_arrived or uploading or self._disagg_writing)

    def close_disaggregation(self) -> None:
        """Stops the stager's and uploader's threads and closes the transfer backend (its
        threads, sockets and process groups); idempotent. The server calls it when it stops."""
        for part in (self.disagg_stager, self.disagg_uploader):
            if part is not None:
                part.close()
        self.disagg_stager = self.disagg_uploader = None
        if self.kv_transfer is not None:
            self.kv_transfer.close()
            logger.info("disaggregation: KV transfer '%s' closed", self.args.disaggregation_transfer_backend)
        self.kv_transfer = None

    def _disagg_stats(self) -> dict[str, Any]:
        if self.kv_transfer is None:
            return {}
        staging = {} if self.disagg_stager is None else {"staging": self.disagg_stager.stats()}
        return {"disaggregation": {"mode": self.disagg_mode, "waiting_for_kv": len(self.disagg_waiting),
                                   "kv_arrived": len(self.disagg_arrived), **self.disagg_counts, **staging,
                                   "backend": self.kv_transfer.stats(), "recent": list(self.disagg_recent)}}


def _rounded(value: Any) -> float | None:
    return None if value is None else round(float(value), 6)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """One-byte float types as uint8: index kernels take bytes, not every float8 type."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8) else t


def _gather(buffers: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """``[num_layers, len(index), ...]``: the rows ``index`` of every layer's buffer, gathered on
    the buffers' device (one copy per layer, into one tensor)."""
    first = buffers[0]
    out = torch.empty((len(buffers), index.numel(), *first.shape[1:]), dtype=first.dtype, device=first.device)
    dest = _bytes(out)
    for layer, buf in enumerate(buffers):
        torch.index_select(_bytes(buf), 0, index, out=dest[layer])
    return out
