"""The scheduler process: a ZeroMQ loop around ``Scheduler``; one per tensor/pipeline rank.

With several ranks every rank runs the same scheduler on the same inputs, in lockstep: rank 0
alone receives from the tokenizer manager, and each loop turn broadcasts what it received (an
empty list when idle) over the gloo CPU group, so every rank admits, batches and retracts
identically. Only rank 0 replies to control requests and sends outputs to the detokenizer
(ranks of other nodes have no IPC at all). A collective that fails (a rank died: gloo sees its
connection close) ends the rank with an error; the launcher then stops the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import traceback
from typing import Any

from engine.cpu_threads import limit_torch_threads_from_env
from engine.distributed import RankPlacement
from engine.errors import EngineError
from engine.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOut,
    ControlReply,
    ControlReq,
    LoadLoraAdapterReqInput,
    LoraAdapterReqOutput,
    SchedulerReady,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UnloadLoraAdapterReqInput,
)
from engine.managers.process_utils import IpcNames, exit_if_orphaned, ignore_group_signals, setup_child_logging

logger = logging.getLogger(__name__)

# Seconds between checks that the parent still exists while the scheduler is busy.
_ORPHAN_CHECK_S = 0.5


def _ready_info(scheduler: Any) -> SchedulerReady:
    import engine.plugins as plugins

    runner = scheduler.runner
    return SchedulerReady(
        max_total_num_tokens=runner.max_total_num_tokens,
        max_running_requests=scheduler.max_running_requests,
        context_len=runner.context_len,
        vocab_size=runner.vocab_size,
        device=str(runner.device),
        attention_backend=runner.attention_backend_name,
        platform=runner.platform.name,
        dtype=str(runner.dtype).replace("torch.", ""),
        eos_token_ids=sorted(scheduler.eos_token_ids),
        plugins=[p.to_dict() for p in plugins.list_plugins(scheduler.args.disable_plugin)],
        task=runner.task,
        embedding_size=runner.embedding_size,
        pooling=runner.pooling_info(),
        multimodal=runner.multimodal,
    )


def scheduler_process(args: Any, model_path: str, ipc: IpcNames | None, ready_conn: Any, parent_pid: int,
                      dp_rank: int = 0, placement: RankPlacement | None = None) -> None:
    """Entry point: joins the replica's process groups, builds the Scheduler, reports readiness,
    then serves forever.

    ``dp_rank``: the data-parallel replica this scheduler serves (``ipc.scheduler`` is that
    replica's own endpoint). ``placement``: this process's tensor/pipeline rank in the replica
    (default: the replica's only rank, on local device ``dp_rank * tp_size``). ``ipc`` is None
    on ranks of nodes other than the first; ``ready_conn`` is this rank's own readiness pipe.
    """
    import engine.distributed as distributed

    if placement is None:
        placement = dataclasses.replace(distributed.SINGLE, local_rank=dp_rank * args.tp_size)
    name = "scheduler" if dp_rank == 0 and args.dp_size == 1 else f"scheduler dp{dp_rank}"
    if placement.world_size > 1:
        name += f" r{placement.rank}"
    setup_child_logging(args.log_level, name)
    ignore_group_signals()
    limit_torch_threads_from_env()  # the size the parent chose for this rank (engine.cpu_threads)
    try:
        platform = join_replica(args, placement)
        scheduler = make_scheduler(args, model_path, platform)
        if placement.dp_attn_size > 1:
            from engine.distributed.dp_attention import check_model_splits_mlps

            check_model_splits_mlps(scheduler.runner.model)
    except EngineError as exc:
        ready_conn.send(("error", str(exc)))
        os._exit(1)
    except Exception as exc:
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        ready_conn.send(("error", f"scheduler failed to start: {type(exc).__name__}: {exc}"))
        os._exit(1)
    ready_conn.send(("ok", _ready_info(scheduler)))
    if not args.skip_tokenizer_init:
        scheduler.grammar_queue.compiler.prepare()  # grammar tables off the first request's path
    ready_conn.close()
    if placement.rank != 0:
        _follow(scheduler, parent_pid, placement)
    assert ipc is not None
    _serve(scheduler, ipc, parent_pid, placement)


def make_scheduler(args: Any, model_path: str, platform: Any) -> Any:
    """The scheduler of this rank: with ``--pp-size`` > 1 the one that keeps micro-batches in flight."""
    if args.pp_size > 1:
        from engine.managers.scheduler_pp import PipelineScheduler

        return PipelineScheduler(args, model_path, platform)
    from engine.managers.scheduler import Scheduler

    return Scheduler(args, model_path, platform)


def share_messages(msgs: list[Any], placement: RankPlacement, pending: list[Any]) -> None:
    """Rank 0: gives this turn's messages to every other rank.

    Without pipeline parallelism a broadcast (the ranks step together anyway). With it, sends
    that do not wait for the receivers (``pending`` keeps them until they complete): rank 0 runs
    up to ``pp_size - 1`` turns ahead of the last stage, which a collective would not allow.
    """
    import engine.distributed as distributed

    if placement.pp_size == 1:
        distributed.broadcast_objects(msgs)
        return
    pending[:] = [p for p in pending if not p.done()]
    pending.append(distributed.isend_objects(msgs, list(range(1, placement.world_size)), distributed.TAG_MESSAGES))


def _finish_sends(pending: list[Any]) -> None:
    """Lets the other ranks receive the shutdown before rank 0 exits (else they see a peer vanish)."""
    for sends in pending:
        try:
            sends.wait()
        except Exception:  # a rank already gone: nothing to tell it
            pass


def receive_messages(placement: RankPlacement) -> list[Any]:
    """Ranks other than 0: rank 0's messages of this turn (``share_messages``)."""
    import engine.distributed as distributed

    if placement.pp_size == 1:
        return distributed.broadcast_objects(None)
    return distributed.recv_objects(0, distributed.TAG_MESSAGES)


def join_replica(args: Any, placement: RankPlacement) -> Any:
    """Joins the replica's process groups; returns the platform (None: the runner selects it).

    Every process of a rank calls it first (the scheduler, ``engine bench one-batch``'s ranks).

    A single rank only records its placement (its device index); several select the platform,
    pin this rank's device and join the groups on the platform's backend.
    """
    import engine.distributed as distributed
    import engine.plugins as plugins

    if placement.world_size == 1 and placement.dp_attn_size == 1:
        distributed.init_distributed(placement, "")
        return None
    platform = plugins.select_platform(args.platform, args.disable_plugin, args.plugin_options)
    try:
        device = platform.device(placement.local_rank)
    except ValueError as exc:  # more ranks on this node than devices
        raise EngineError(f"{placement.describe()}: {exc}") from None
    platform.set_device(device)
    distributed.init_distributed(placement, platform.distributed_backend(),
                                 custom_all_reduce=args.enable_custom_all_reduce)
    return platform


def _serve(scheduler: Any, ipc: IpcNames, parent_pid: int, placement: RankPlacement) -> None:
    """Rank 0: receive from the tokenizer manager, share with the other ranks, step, emit."""
    import zmq

    shared = placement.world_size > 1
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(ipc.scheduler)
    to_detok = ctx.socket(zmq.PUSH)
    to_detok.connect(ipc.detokenizer)
    to_tokenizer = ctx.socket(zmq.PUSH)
    to_tokenizer.connect(ipc.tokenizer)
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    pending: list[Any] = []  # message sends to the other ranks not yet complete
    next_orphan_check = 0.0
    turns = None
    stopping = False  # DP attention: asked to stop; the replicas stop together at the next turn
    if placement.dp_attn_size > 1:  # DP attention: the replicas step together
        from engine.managers.dp_attention_turns import DPAttentionTurns

        turns = DPAttentionTurns(scheduler)
    try:
        while True:
            if turns is None:
                timeout = 0 if scheduler.has_work() else 500
            else:  # the other replicas wait for this one's turn: poll briefly
                timeout = 0 if scheduler.has_work() or turns.any_busy else 20
            msgs = []
            if poller.poll(timeout):
                while True:
                    try:
                        msgs.append(recv.recv_pyobj(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if shared:  # every turn, even empty: the other ranks step when rank 0 does
                share_messages(msgs, placement, pending)
            for msg in msgs:
                if isinstance(msg, ControlReq) and msg.kind == "shutdown":
                    if turns is not None:
                        stopping = True
                        continue
                    logger.info("stopping: the server asked")
                    _finish_sends(pending)
                    _close_transfers(scheduler)
                    os._exit(0)
                reply = _dispatch(scheduler, msg)
                if reply is not None:
                    to_tokenizer.send_pyobj(reply)
            now = time.monotonic()
            if now >= next_orphan_check:  # also while busy: outputs to a dead parent would block forever
                exit_if_orphaned(parent_pid, ipc)
                next_orphan_check = now + _ORPHAN_CHECK_S
            if turns is None:
                scheduler.step()
            elif turns.step(stopping):
                logger.info("stopping: the server asked")
                os._exit(0)
            for out in scheduler.take_outputs():
                # Vectors need no detokenizing: straight to the tokenizer manager.
                (to_tokenizer if isinstance(out, BatchEmbeddingOut) else to_detok).send_pyobj(out)
    except Exception as exc:
        # The parent's watchdog sees the exit code and fails pending requests.
        _crashed(exc, placement)
    os._exit(0)


def _close_transfers(scheduler: Any) -> None:
    """Stops the KV transfer of ``--disaggregation-mode`` before the process exits (``os._exit``
    runs no finalisers): its threads end and its sockets and process groups close in order."""
    try:
        scheduler.close_disaggregation()
    except Exception:  # noqa: BLE001 - the process exits either way
        logger.exception("closing the KV transfer failed")


def _follow(scheduler: Any, parent_pid: int, placement: RankPlacement) -> None:
    """Ranks other than 0: take rank 0's messages each turn and step in lockstep; emit nothing."""
    next_orphan_check = 0.0
    try:
        while True:
            for msg in receive_messages(placement):
                if isinstance(msg, ControlReq) and msg.kind == "shutdown":
                    logger.info("stopping: rank 0 asked")
                    os._exit(0)
                _dispatch(scheduler, msg)
            now = time.monotonic()
            if now >= next_orphan_check:
                exit_if_orphaned(parent_pid)
                next_orphan_check = now + _ORPHAN_CHECK_S
            scheduler.step()
            scheduler.take_outputs()
    except Exception as exc:
        _crashed(exc, placement)
    os._exit(0)


def _crashed(exc: BaseException, placement: RankPlacement) -> None:
    if placement.world_size > 1 and _is_peer_failure(exc):
        # Another rank died or hung: one line, not a traceback of torch.distributed internals.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.error("%s: a collective with the other ranks failed (%s): another rank has exited; stopping",
                     placement.describe(), first[:300])
    else:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
    os._exit(1)


def _is_peer_failure(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return any(k in text for k in ("gloo", "nccl", "connection", "timed out", "timeout", "distbackenderror",
                                   "peer", "socket"))


def _dispatch(scheduler: Any, msg: Any) -> ControlReply | LoraAdapterReqOutput | None:
    if isinstance(msg, TokenizedGenerateReqInput):
        try:
            scheduler.add_request(msg)
        except EngineError as exc:  # validated upstream; a backstop for direct senders
            from engine.managers.schedule_batch import FinishReason, Req
            from engine.sampling.sampling_params import SamplingParams

            req = Req(msg.rid, msg.input_ids, SamplingParams(), set())
            req.finished_reason = FinishReason("abort", message=str(exc))
            scheduler._emit([req])
        return None
    if isinstance(msg, TokenizedEmbeddingReqInput):
        scheduler.add_embedding_request(msg)
        return None
    if isinstance(msg, AbortReq):
        scheduler.abort_request(msg.rid, msg.message)
        return None
    if isinstance(msg, LoadLoraAdapterReqInput):
        return scheduler.load_lora_adapter(msg)
    if isinstance(msg, UnloadLoraAdapterReqInput):
        return scheduler.unload_lora_adapter(msg)
    if isinstance(msg, ControlReq):
        if msg.kind == "flush_cache":
            return ControlReply(msg.kind, msg.token, ok=scheduler.flush_cache())
        if msg.kind in ("server_info", "health"):
            return ControlReply(msg.kind, msg.token, data=scheduler.stats())
        if msg.kind == "requests":  # the live view's table (managers/timeline.py)
            from engine.managers.timeline import live_requests

            return ControlReply(msg.kind, msg.token, data=live_requests(scheduler))
        return ControlReply(msg.kind, msg.token, ok=False, data={"error": f"unknown control '{msg.kind}'"})
    logger.warning("scheduler ignored a message of type %s", type(msg).__name__)
    return None
