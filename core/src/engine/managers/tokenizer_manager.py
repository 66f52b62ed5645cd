"""The tokenizer manager (main process, asyncio): validate, tokenize, track, stream.

Keeps one ``ReqState`` per request, sends tokenized requests to the scheduler,
and receives detokenized increments from the detokenizer. A watchdog fails
every pending request within a second when a child process dies. Tokenization
runs on a small thread pool (``managers/tokenizer_pool.py``) so one huge prompt
cannot stall the event loop; graceful shutdown drains through ``drain``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.managers.arrivals import Arrivals
from engine.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOut,
    BatchStrOut,
    ControlReply,
    ControlReq,
    LoraAdapterReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from engine.constrained.base import GrammarError, GrammarKey
from engine.constrained.validation import GrammarValidator
from engine.managers.request_state import (  # noqa: F401  (public here since the start)
    EngineDeadError,
    ReqState,
    RequestError,
    ServerShuttingDownError,
)
from engine.managers.tokenizer_embed import EmbedMixin, EmbeddingRequest, EmbeddingResult  # noqa: F401
from engine.managers.tokenizer_mm import MultimodalMixin, native_media
from engine.managers.tokenizer_lora import LORA_TIMEOUT_S, LoraMixin  # noqa: F401  (public: the HTTP routes' timeout)
from engine.managers.tokenizer_pool import TextTooLongError, TokenizerPool
from engine.router.router import Router, merge_control_replies
from engine.sampling.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

# The most queued scheduler messages applied in one turn of the event loop (the streams then run).
_DRAIN_MAX = 64


@dataclass
class GenerateRequest:
    """One generation request (a batch is expanded into these by the caller)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    priority: int = 0
    # Images and video of a text prompt (SGLang's native fields; the text holds one placeholder per item):
    # a data: URL, file path or URL per image; per video a list of frames.
    image_data: Any = None
    video_data: Any = None
    # Set when the prompt is processed (chat image parts, image_data): the items its ids carry.
    mm_items: list[Any] = field(default_factory=list)
    # The LoRA adapter to run with: its name, or the path it was loaded from; None: the base model.
    lora_path: str | None = None
    # Prefill/decode disaggregation (docs/disaggregation.md): the prefill server's KV transfer
    # address and the room the router gave the request; None: an ordinary request.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class TokenizerManager(MultimodalMixin, EmbedMixin, LoraMixin):
    #: Whether ``submit`` sends a request to the scheduler at once: the HTTP routes then send a
    #: response's requests from its handler (``start_requests``). A subclass that produces
    #: outputs in its own ``generate`` without a scheduler (the HTTP tests' scripted managers)
    #: sets it False: its requests go through ``generate`` when their outputs are first read.
    sends_on_submit: ClassVar[bool] = True

    def __init__(self, args: Any, model_path: str, ipc: Any, ready: SchedulerReady,
                 processes: list[Any], tokenizer: Any | None) -> None:
        import zmq
        import zmq.asyncio

        self.args = args
        self.model_path = model_path
        self.ready = ready
        self.processes = processes
        self.tokenizer = tokenizer
        self.context_len = ready.context_len
        self.zmq_ctx = zmq.asyncio.Context()
        self.recv = self.zmq_ctx.socket(zmq.PULL)
        self.recv.bind(ipc.tokenizer)
        # One PUSH socket per data-parallel replica's scheduler; ``send`` is replica 0's.
        self.sends = []
        for dp_rank in range(getattr(args, "dp_size", 1)):
            sock = self.zmq_ctx.socket(zmq.PUSH)
            sock.connect(ipc.replica_scheduler(dp_rank))
            self.sends.append(sock)
        self.send = self.sends[0]
        self.router = _make_router(args)
        # Observers notified of each routing decision: (request id, RouteDecision) (metrics).
        self.on_route: list[Any] = []
        self.states: dict[str, ReqState] = {}
        # Futures of control and LoRA load/unload requests, by token, until their reply comes.
        self.control_waiters: dict[int, asyncio.Future[Any]] = {}
        self._tokens = itertools.count(1)
        self.dead: str | None = None
        # Set by ``drain``: requests that arrive from then on are refused with ServerShuttingDownError.
        self.draining = False
        # Which requests arrived before the drain began (the HTTP server shares its own here).
        self.arrivals = Arrivals()
        self.pool = TokenizerPool(tokenizer, getattr(args, "tokenizer_workers", 0), ready.context_len)
        # Ids that stand for several requests (a request's rid when n > 1 or a batch) -> their rids.
        self.groups: dict[str, set[str]] = {}
        self._group_of: dict[str, list[str]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # Observers notified on each finished request (metrics).
        self.on_finish: list[Any] = []

    # -- background tasks ------------------------------------------------------
    def start(self) -> None:
        """Starts the receive loop and the watchdog on the running event loop (idempotent)."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._handle_loop()), loop.create_task(self._watchdog())]

    async def _handle_loop(self) -> None:
        import zmq

        # The receiving socket read without waiting (the same socket; only this loop reads it).
        recv_now = zmq.Socket.shadow(self.recv.underlying)
        while True:
            self._dispatch(await self.recv.recv_pyobj())
            # Apply every message that has already arrived before the streams run: a stream then
            # wakes once for all its new tokens (one event) rather than once per message. An HTTP
            # process that falls behind a fast scheduler so sends fewer, larger events, instead
            # of falling further behind one event per token.
            for _ in range(_DRAIN_MAX):
                try:
                    msg = recv_now.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._dispatch(msg)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOut):
            self._handle_str_out(msg)
        elif isinstance(msg, BatchEmbeddingOut):
            self._handle_embedding_out(msg)
        elif isinstance(msg, (ControlReply, LoraAdapterReqOutput)):
            fut = self.control_waiters.pop(msg.token, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def _watchdog(self) -> None:
        while self.dead is None:
            await asyncio.sleep(0.25)
            for proc in self.processes:
                if not proc.is_alive():
                    self.dead = f"engine process '{proc.name}' died (exit code {proc.exitcode})"
                    logger.error("%s; failing %d pending requests", self.dead, len(self.states))
                    self._fail_all(EngineDeadError(self.dead))
                    for fut in self.control_waiters.values():
                        if not fut.done():
                            fut.set_exception(EngineDeadError(self.dead))
                    break

    def _handle_str_out(self, msg: BatchStrOut) -> None:
        now = time.perf_counter()
        for i, rid in enumerate(msg.rids):
            state = self.states.get(rid)
            if state is None:
                continue
            state.text += msg.new_texts[i]
            state.output_ids.extend(msg.new_token_ids[i])
            if msg.output_token_logprobs and msg.output_token_logprobs[i]:
                state.output_token_logprobs.extend(msg.output_token_logprobs[i])
                state.output_top_logprobs.extend(msg.output_top_logprobs[i])
            if msg.input_token_logprobs and msg.input_token_logprobs[i] is not None:
                state.input_token_logprobs = msg.input_token_logprobs[i]
                state.input_top_logprobs = msg.input_top_logprobs[i]
            state.meta.update(prompt_tokens=msg.prompt_tokens[i], completion_tokens=msg.completion_tokens[i],
                              cached_tokens=msg.cached_tokens[i])
            if msg.spec_verify_ct is not None:
                state.meta.update(spec_verify_ct=msg.spec_verify_ct[i], spec_accepted_tokens=msg.spec_accepted_tokens[i])
            if msg.stages is not None and msg.stages[i] is not None:
                state.meta["stages"] = msg.stages[i]  # the scheduler's stage times (managers/timeline.py)
            if state.first_token_time is None and msg.new_token_ids[i]:
                state.first_token_time = now
            state.last_time = now
            reason = msg.finished_reasons[i]
            if reason is not None:
                state.finished_reason = reason
                if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
                    # The scheduler ends such a request itself (managers/stop_strings.py); this
                    # abort covers a match only the detokenizer saw (its final flush), a no-op else.
                    self._send_for(rid, AbortReq(rid, "stop string"))
            state.event.set()

    # -- requests ----------------------------------------------------------------
    def tokenize(self, req: GenerateRequest) -> list[int]:
        if req.image_data is not None or req.video_data is not None:
            text, media = self._media_prompt(req)
            ids, req.mm_items = self.process_media_sync(text, media, True, "text")
            return ids
        if req.input_ids is not None:
            return self._checked_ids(req.input_ids)
        if req.text is None:
            raise RequestError("either text or input_ids is required", "text")
        if not isinstance(req.text, str):
            raise RequestError("text: expected a string", "text")
        if self.tokenizer is None:
            raise RequestError("text: this server runs with --skip-tokenizer-init; send input_ids", "text")
        try:
            return self.pool.encode_sync(req.text)
        except TextTooLongError as exc:
            raise RequestError(f"text: {exc}", "text") from None

    def _checked_ids(self, ids: Any) -> list[int]:
        """A copy of a prompt's token ids after checking they are ints (not bools) in the vocabulary.

        The common case is checked by C-level passes (map, count, min, max) rather than a Python
        loop per id: every prompt of a burst passes here, on the HTTP process's one core, before
        the scheduler sees it (1,024 ids: ~0.3 ms by the loop, ~0.1 ms so, on a shared 2-core CPU)."""
        vocab = self.ready.vocab_size
        if not isinstance(ids, list):
            raise RequestError("input_ids: expected a list of integers", "input_ids")
        if list(map(type, ids)).count(int) != len(ids):  # some id is not exactly an int: the full check
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestError("input_ids: expected a list of integers", "input_ids")
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise RequestError(f"input_ids: token id {bad} is outside the vocabulary (0..{vocab - 1})", "input_ids")
        return list(ids)

    async def tokenize_async(self, req: GenerateRequest) -> list[int]:
        """``tokenize`` with long texts on the tokenizer pool (the event loop stays free)."""
        if req.image_data is not None or req.video_data is not None:
            text, media = self._media_prompt(req)
            ids, req.mm_items = await self.process_media(text, media, True, "text")
            return ids
        if isinstance(req.text, str) and req.input_ids is None and self.tokenizer is not None:
            try:
                return await self.pool.encode(req.text)
            except TextTooLongError as exc:
                raise RequestError(f"text: {exc}", "text") from None
        return self.tokenize(req)

    def _media_prompt(self, req: GenerateRequest) -> tuple[str, list[Any]]:
        media = native_media(req.image_data, req.video_data)
        if media:
            self.check_takes_media(media[0].param, media[0].modality)
        if not isinstance(req.text, str) or req.input_ids is not None:
            raise RequestError("image_data/video_data: need a text prompt holding the model's placeholders "
                               "(not input_ids)", "text")
        return req.text, media

    def validate(self, req: GenerateRequest, input_ids: list[int]) -> SamplingParams:
        self.check_generation_task("generation")
        try:
            params = SamplingParams.from_dict(req.sampling_params)
        except SamplingParamsError as exc:
            raise RequestError(str(exc), exc.field) from None
        except TypeError as exc:
            raise RequestError(f"sampling_params: {exc}", "sampling_params") from None
        if not input_ids:
            raise RequestError("the prompt is empty", "text" if req.text is not None else "input_ids")
        if len(input_ids) >= self.context_len:
            raise RequestError(
                f"the prompt has {len(input_ids)} tokens; this model's context length is {self.context_len}",
                "text" if req.text is not None else "input_ids")
        if req.top_logprobs_num < 0 or req.top_logprobs_num > 20:
            raise RequestError(f"top_logprobs_num: invalid value {req.top_logprobs_num}; accepted: 0..20", "top_logprobs_num")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"stop: invalid value {params.stop!r}; this server runs with --skip-tokenizer-init and "
                               "has no text to match stop strings in; use stop_token_ids", "stop")
        self._check_structured(params)
        self.lora.resolve(req.lora_path)
        return params

    @functools.cached_property
    def grammar_validator(self) -> GrammarValidator:
        """Checks grammars before they are queued (a bad schema, regex or EBNF is a 400 here)."""
        args = self.args
        return GrammarValidator(getattr(args, "grammar_backend", "xgrammar"), self.tokenizer, self.ready.vocab_size,
                                self.ready.eos_token_ids, getattr(args, "disable_plugin", []),
                                getattr(args, "plugin_options", {}))

    def _check_structured(self, params: SamplingParams) -> None:
        """Grammar (json_schema, regex, ebnf, structural_tag) and logit_bias token ids."""
        key = GrammarKey.of(params)
        if key is not None:
            try:
                self.grammar_validator.check(key)
            except GrammarError as exc:
                raise RequestError(str(exc), exc.field) from None
        vocab = self.ready.vocab_size
        bad = next((t for t in (params.logit_bias or {}) if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is outside the vocabulary (0..{vocab - 1})", "logit_bias")

    def prepare(self, req: GenerateRequest) -> tuple[list[int], SamplingParams]:
        """Tokenizes and validates without sending (raises RequestError); blocks the caller."""
        ids = self.tokenize(req)
        return ids, self.validate(req, ids)

    async def prepare_async(self, req: GenerateRequest) -> tuple[list[int], SamplingParams]:
        """``prepare`` for the server: long texts are tokenized on the pool."""
        ids = await self.tokenize_async(req)
        return ids, self.validate(req, ids)

    async def generate(self, req: GenerateRequest, prepared: tuple[list[int], SamplingParams] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Sends one request and yields its output dicts (cumulative ``text``/``output_ids``).

        Streaming requests yield after every increment; others yield once at the end.
        The caller aborts by closing the generator (e.g. on client disconnect).
        """
        stream = self.submit(req, prepared)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def submit(self, req: GenerateRequest, prepared: tuple[list[int], SamplingParams] | None = None) -> RequestStream:
        """Sends one request to the scheduler now and returns its outputs as a ``RequestStream``
        (``generate`` sends when first iterated). Raises what ``generate`` raises before its first output."""
        self._check_alive()
        if self.refuses_new():
            raise ServerShuttingDownError("the server is shutting down and accepts no new requests")
        self.start()
        input_ids, params = prepared or self.prepare(req)
        # Resolved again as it is sent: the adapter may have been unloaded since ``prepare``.
        lora_name = self.lora.resolve(req.lora_path)
        rid = req.rid or uuid.uuid4().hex
        if rid in self.states:
            raise RequestError(f"rid: a request with id '{rid}' is already running", "rid")
        state = ReqState(rid, input_ids)
        if lora_name is not None:
            state.meta["lora_name"] = lora_name  # for /metrics (engine_lora_requests_total)
        decision = self.router.route(rid, input_ids)
        if self.router.num_replicas > 1:
            state.meta["dp_rank"] = decision.replica
        for callback in self.on_route:
            callback(rid, decision)
        self.states[rid] = state
        logprob_start = req.logprob_start_len
        if req.return_logprob and logprob_start < 0:
            logprob_start = len(input_ids)  # output logprobs only
        self.sends[decision.replica].send_pyobj(TokenizedGenerateReqInput(
            rid=rid, input_ids=input_ids, sampling_params=params.to_dict(),
            return_logprob=req.return_logprob, logprob_start_len=logprob_start,
            top_logprobs_num=req.top_logprobs_num, stream=req.stream, priority=req.priority, mm_items=req.mm_items, lora_name=lora_name,
            bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port, bootstrap_room=req.bootstrap_room))
        return RequestStream(self, state, req.stream)

    def _release(self, state: ReqState, finished: bool) -> None:
        """A request's stream ended: forget it; abort it if it had not finished."""
        rid = state.rid
        self.states.pop(rid, None)
        self._leave_groups(rid)
        if not finished and self.dead is None:
            self._send_for(rid, AbortReq(rid, "client disconnected"))
        self.router.finish(rid)
        if finished:
            for callback in self.on_finish:
                callback(state)

    def _output(self, state: ReqState) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": state.rid,
            "prompt_tokens": state.meta.get("prompt_tokens", len(state.prompt_ids)),
            "completion_tokens": state.meta.get("completion_tokens", len(state.output_ids)),
            "cached_tokens": state.meta.get("cached_tokens", 0),
            "finish_reason": state.finished_reason,
            "e2e_latency": (state.last_time or time.perf_counter()) - state.created,
        }
        if "spec_verify_ct" in state.meta:  # speculative decoding: tokens per verify forward
            verify, kept = state.meta["spec_verify_ct"], state.meta["spec_accepted_tokens"]
            meta.update(spec_verify_ct=verify, spec_accepted_tokens=kept,
                        spec_accept_length=(kept + verify) / verify if verify else 0.0)
        if "dp_rank" in state.meta:  # the data-parallel replica that served it (--dp-size > 1)
            meta["dp_rank"] = state.meta["dp_rank"]
        if state.output_token_logprobs or state.input_token_logprobs is not None:
            meta["output_token_logprobs"] = list(state.output_token_logprobs)
            meta["output_top_logprobs"] = list(state.output_top_logprobs)
            meta["input_token_logprobs"] = state.input_token_logprobs
            meta["input_top_logprobs"] = state.input_top_logprobs
        return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}

    def add_group(self, group_rid: str, rids: list[str]) -> None:
        """Makes ``group_rid`` stand for ``rids`` in ``abort`` (the n choices or batch of one request)."""
        self.groups.setdefault(group_rid, set()).update(rids)
        for rid in rids:
            self._group_of.setdefault(rid, []).append(group_rid)

    def _leave_groups(self, rid: str) -> None:
        for group_rid in self._group_of.pop(rid, []):
            members = self.groups.get(group_rid)
            if members is not None:
                members.discard(rid)
                if not members:
                    del self.groups[group_rid]

    def abort(self, rid: str, message: str = "aborted by request") -> list[str]:
        """Aborts a request, every request a group id stands for, or all with ``rid`` "".

        Returns the ids of the running requests aborted (empty: nothing by that id runs).
        """
        targets = self.abort_targets(rid)
        for target in targets:
            self._send_for(target, AbortReq(target, message))
        return targets

    def _send_for(self, rid: str, msg: Any) -> None:
        """Sends ``msg`` to the replica serving ``rid`` (every replica when none is known)."""
        replica = self.router.replica_of(rid)
        for sock in self.sends if replica is None else [self.sends[replica]]:
            sock.send_pyobj(msg)

    def abort_targets(self, rid: str) -> list[str]:
        """The running requests ``rid`` names: itself, a group's members, or all for ""."""
        if rid == "":
            return sorted(self.states)
        if rid in self.groups:
            return sorted(r for r in self.groups[rid] if r in self.states)
        return [rid] if rid in self.states else []

    def refuses_new(self) -> bool:
        """Whether a request starting in this context is refused: the server is draining and the
        request arrived after the drain began (or the grace period is over)."""
        return self.draining and not self.arrivals.admitted()

    async def drain(self, grace_s: float) -> int:
        """Graceful shutdown: refuse requests that arrive from now on; let every request that had
        arrived finish within ``grace_s`` (those running, those still being read or tokenized,
        ``Arrivals``), then fail the rest with ServerShuttingDownError. Returns how many were failed."""
        self.draining = True
        arrivals = self.arrivals
        arrivals.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while ((self.states or self.pool.in_flight or arrivals.open) and self.dead is None
               and loop.time() < deadline):
            await asyncio.sleep(0.05)
        arrivals.close()
        left = len(self.states)
        if left and self.dead is None:
            logger.warning("%d request(s) still running after the %.3g s shutdown grace period; ending them",
                           left, grace_s)
            self._fail_all(ServerShuttingDownError(
                f"the server is shutting down; the request did not finish within the {grace_s:g} s grace period"))
        return left

    def _fail_all(self, error: BaseException) -> None:
        for state in self.states.values():
            state.error = error
            state.event.set()

    async def control(self, kind: str, timeout: float = 10.0) -> ControlReply:
        """Sends a control request to every replica; one reply (merged over the replicas with
        ``--dp-size`` > 1: ``ok`` when all are, numbers summed, ``data["dp_replicas"]`` each one's)."""
        replies = await self.control_replicas(kind, timeout)
        reply = replies[0] if len(replies) == 1 else merge_control_replies(replies)
        if kind == "flush_cache" and reply.ok:
            self.router.flushed()
        return reply

    async def control_replicas(self, kind: str, timeout: float = 10.0) -> list[ControlReply]:
        """The control reply of each data-parallel replica, in replica order."""
        self._check_alive()
        self.start()
        loop = asyncio.get_running_loop()
        tokens, futures = [], []
        for sock in self.sends:
            token = next(self._tokens)
            fut: asyncio.Future[ControlReply] = loop.create_future()
            self.control_waiters[token] = fut
            tokens.append(token)
            futures.append(fut)
            sock.send_pyobj(ControlReq(kind, token))
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), timeout))
        finally:
            for token in tokens:
                self.control_waiters.pop(token, None)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        self.pool.close()
        self.recv.close(0)
        for sock in self.sends:
            sock.close(0)
        self.zmq_ctx.term()


class RequestStream:
    """The outputs of a request ``TokenizerManager.submit`` sent: async-iterate for its output dicts
    (cumulative ``text``/``output_ids``; after every increment when streaming, else once at the end).

    ``aclose`` ends it, sending the scheduler an abort if the request has not finished; unlike an
    async generator's, it also ends a stream that was never iterated (a client that went away
    before its response started)."""

    __slots__ = ("_manager", "_state", "_stream", "_finished", "_closed")

    def __init__(self, manager: TokenizerManager, state: ReqState, stream: bool) -> None:
        self._manager = manager
        self._state = state
        self._stream = stream
        self._finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._finished or self._closed:
            await self.aclose()
            raise StopAsyncIteration
        state = self._state
        while True:
            await state.event.wait()
            state.event.clear()
            if state.error is not None:
                raise state.error
            self._finished = state.finished_reason is not None
            if self._stream or self._finished:
                return self._manager._output(state)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._manager._release(self._state, self._finished)


def _make_router(args: Any) -> Router:
    """The router over ``--dp-size`` replicas with the ``--router-policy`` plugin (none for one)."""
    dp_size = getattr(args, "dp_size", 1)
    if dp_size == 1:
        return Router(1)
    import engine.plugins as plugins

    policy = plugins.create_router_policy(args.router_policy, dp_size, args.disable_plugin, args.plugin_options)
    return Router(dp_size, policy, args.router_policy)
