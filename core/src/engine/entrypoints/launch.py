"""Starting and stopping the scheduler and detokenizer processes."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any

from engine import plugins
from engine.config import ServerArgs, check_required_plugins
from engine.errors import ConfigError, EngineError
from engine.managers.io_struct import SchedulerReady
from engine.managers.process_utils import IpcNames

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 1800.0


def resolve_model_path(args: ServerArgs) -> str:
    if args.model_path:
        return args.model_path
    from engine.default_model import ensure_default_model

    return ensure_default_model()


def preflight(args: ServerArgs, model_path: str) -> Any:
    """Checks in this process what can be checked cheaply, so errors come fast and clean."""
    from engine.model_executor.model_loader import load_hf_config

    check_required_plugins(args.required_plugins)
    disabled = args.disable_plugin
    config = load_hf_config(model_path, args.trust_remote_code)
    plugins.get_model_spec(config.architectures[0], disabled)
    plugins.get_schedule_policy(args.schedule_policy, disabled)
    from engine.model_executor.model_runner import resolve_attention_name

    platform = plugins.select_platform(args.platform, disabled)
    plugins.get_attention_backend(resolve_attention_name(args, platform), disabled)
    if args.quant:
        plugins.get_quantization_method(args.quant, disabled)
    _check_plugin_options(args)
    return config


def _check_plugin_options(args: ServerArgs) -> None:
    declared = plugins.plugin_options(args.disable_plugin)
    for plugin, values in args.plugin_options.items():
        for key in values:
            if f"{plugin}.{key}" not in declared:
                known = sorted(declared)
                raise ConfigError(f"plugin_options: unknown option '{plugin}.{key}'; declared: {', '.join(known) or 'none'}")


@dataclass
class Runtime:
    args: ServerArgs
    model_path: str
    ipc: IpcNames
    processes: list[Any]
    ready: SchedulerReady

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the engine processes: asks them over IPC (they ignore SIGTERM, which a supervisor
        sends the whole group), waits up to ``timeout`` s, then kills what is left."""
        if self.ready is None:
            timeout = 0.0  # still loading the model: it reads no messages until it is done
        else:
            _ask_to_stop(self.ipc)
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self.ipc.remove()


def _ask_to_stop(ipc: IpcNames) -> None:
    """Sends ``ControlReq("shutdown")`` to the scheduler and the detokenizer (never blocks)."""
    import zmq

    from engine.managers.io_struct import ControlReq

    ctx = zmq.Context()
    try:
        for endpoint in (ipc.scheduler, ipc.detokenizer):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 500)  # time to deliver; a dead peer is killed below anyway
            sock.connect(endpoint)
            try:
                sock.send_pyobj(ControlReq("shutdown"), zmq.NOBLOCK)
            except zmq.Again:
                pass
            sock.close()
    finally:
        ctx.term()


def launch_runtime(args: ServerArgs) -> Runtime:
    """Starts the scheduler and detokenizer processes and waits until the model is loaded."""
    from engine.managers.detokenizer_manager import detokenizer_process
    from engine.managers.scheduler_process import scheduler_process

    model_path = resolve_model_path(args)
    preflight(args, model_path)
    ipc = IpcNames.create()
    ctx = mp.get_context("spawn")
    parent_pid = os.getpid()
    reader, writer = ctx.Pipe(duplex=False)
    scheduler = ctx.Process(target=scheduler_process, name="scheduler",
                            args=(args, model_path, ipc, writer, parent_pid), daemon=True)
    detok = ctx.Process(target=detokenizer_process, name="detokenizer",
                        args=(args, model_path, ipc, parent_pid), daemon=True)
    scheduler.start()
    detok.start()
    writer.close()
    runtime_procs = [scheduler, detok]
    try:
        ready = _wait_ready(reader, scheduler)
    except BaseException:
        Runtime(args, model_path, ipc, runtime_procs, None).shutdown()  # type: ignore[arg-type]
        raise
    return Runtime(args, model_path, ipc, runtime_procs, ready)


def _wait_ready(reader: Any, proc: Any) -> SchedulerReady:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if reader.poll(0.2):
            try:
                status, payload = reader.recv()
            except EOFError:
                break
            if status == "ok":
                return payload
            raise EngineError(payload)
        if not proc.is_alive():
            break
    raise EngineError(f"the scheduler process exited during start-up (exit code {proc.exitcode}); see its log above")
