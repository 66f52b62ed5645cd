"""The scheduler process: a ZeroMQ loop around ``Scheduler``."""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any

from engine.errors import EngineError
from engine.managers.io_struct import (
    AbortReq,
    ControlReply,
    ControlReq,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from engine.managers.process_utils import IpcNames, exit_if_orphaned, ignore_group_signals, setup_child_logging

logger = logging.getLogger(__name__)

# Seconds between checks that the parent still exists while the scheduler is busy.
_ORPHAN_CHECK_S = 0.5


def _ready_info(scheduler: Any) -> SchedulerReady:
    from engine import plugins

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
    )


def scheduler_process(args: Any, model_path: str, ipc: IpcNames, ready_conn: Any, parent_pid: int,
                      dp_rank: int = 0) -> None:
    """Entry point: builds the Scheduler, reports readiness, then serves forever.

    ``dp_rank``: the data-parallel replica this scheduler serves (``ipc.scheduler`` is that
    replica's own endpoint).
    """
    import zmq

    from engine.managers.scheduler import Scheduler

    setup_child_logging(args.log_level, "scheduler" if dp_rank == 0 and args.dp_size == 1 else f"scheduler dp{dp_rank}")
    ignore_group_signals()
    try:
        scheduler = Scheduler(args, model_path)
    except EngineError as exc:
        ready_conn.send(("error", str(exc)))
        os._exit(1)
    except Exception as exc:
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        ready_conn.send(("error", f"scheduler failed to start: {type(exc).__name__}: {exc}"))
        os._exit(1)
    ready_conn.send(("ok", _ready_info(scheduler)))

    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(ipc.scheduler)
    to_detok = ctx.socket(zmq.PUSH)
    to_detok.connect(ipc.detokenizer)
    to_tokenizer = ctx.socket(zmq.PUSH)
    to_tokenizer.connect(ipc.tokenizer)
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    next_orphan_check = 0.0
    try:
        while True:
            timeout = 0 if scheduler.has_work() else 500
            if poller.poll(timeout):
                while True:
                    try:
                        msg = recv.recv_pyobj(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if isinstance(msg, ControlReq) and msg.kind == "shutdown":
                        logger.info("stopping: the server asked")
                        os._exit(0)
                    reply = _dispatch(scheduler, msg)
                    if reply is not None:
                        to_tokenizer.send_pyobj(reply)
            now = time.monotonic()
            if now >= next_orphan_check:  # also while busy: outputs to a dead parent would block forever
                exit_if_orphaned(parent_pid, ipc)
                next_orphan_check = now + _ORPHAN_CHECK_S
            scheduler.step()
            for out in scheduler.take_outputs():
                to_detok.send_pyobj(out)
    except Exception:
        # The parent's watchdog sees the exit code and fails pending requests.
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _dispatch(scheduler: Any, msg: Any) -> ControlReply | None:
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
    if isinstance(msg, AbortReq):
        scheduler.abort_request(msg.rid, msg.message)
        return None
    if isinstance(msg, ControlReq):
        if msg.kind == "flush_cache":
            return ControlReply(msg.kind, msg.token, ok=scheduler.flush_cache())
        if msg.kind in ("server_info", "health"):
            return ControlReply(msg.kind, msg.token, data=scheduler.stats())
        return ControlReply(msg.kind, msg.token, ok=False, data={"error": f"unknown control '{msg.kind}'"})
    logger.warning("scheduler ignored a message of type %s", type(msg).__name__)
    return None
