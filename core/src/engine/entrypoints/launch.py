"""Starting and stopping the scheduler and detokenizer processes."""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from engine.config import ServerArgs
from engine.errors import EngineError
from engine.managers.io_struct import SchedulerReady
from engine.managers.process_utils import IpcNames

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 1800.0


def resolve_model_path(args: ServerArgs) -> str:
    """The Hugging Face directory to load: the default model or a GGUF converted once, or the path."""
    from engine.model_executor.checkpoint import resolve_checkpoint

    if not args.model_path and args.task == "embed":
        from engine.default_model.embedding import embedding_model_dir

        return embedding_model_dir()  # the embedded all-MiniLM-L6-v2, unzipped once
    if not args.model_path and args.task == "score":
        from engine.errors import ConfigError

        raise ConfigError("--task score: no embedded scoring model; accepted: --model-path DIR of a "
                          "*ForSequenceClassification checkpoint")
    # --quant gguf reads every tensor from the GGUF: its conversion needs no dequantized weights.
    return resolve_checkpoint(args.model_path or None, args.disable_plugin, weights=args.quant != "gguf")


def preflight(args: ServerArgs, model_path: str, config: Any = None) -> Any:
    """Runs in this process every check that needs no weights, so errors come fast and clean.
    ``config``: the checkpoint's config when already read (None: read here).

    The selection is the same ``select_components`` the scheduler process builds from, so a
    run that passes here fails later only for reasons that need the weights or the device.
    """
    from engine.model_executor.checkpoint import load_hf_config
    from engine.pooling import check_task
    from engine.preflight import check_without_checkpoint, parser_log_lines, speed_notes
    from engine.selection import select_components

    # The checks ``engine config show`` runs (``start_runtime`` ran them before any child started;
    # they read registered specs, so again costs little); then those that need the checkpoint's config.
    check_without_checkpoint(args)
    for line in parser_log_lines(args):
        logger.info(line)
    if config is None:
        config = load_hf_config(model_path, args.trust_remote_code)
    check_task(args, config)
    selection = select_components(args, config)
    for note in speed_notes(selection):
        logger.warning(note)
    check_parallel_layout(args, config, selection.platform)
    return config


def check_parallel_layout(args: ServerArgs, hf_config: Any, platform: Any) -> None:
    """The model splits ``--tp-size`` x ``--pp-size`` ways, and this node has a device per rank."""
    from engine.distributed import check_model_parallel

    check_model_parallel(hf_config, args.tp_size, args.pp_size, args.ep_size)
    # DP attention: each replica is one rank.
    replica = 1 if getattr(args, "enable_dp_attention", False) else args.tp_size * args.pp_size
    per_node = replica // args.nnodes * args.dp_size
    if per_node > 1 and platform.device_type != "cpu":
        try:
            platform.device(per_node - 1)
        except ValueError as exc:
            raise EngineError(f"--tp-size {args.tp_size} x --pp-size {args.pp_size} x --dp-size {args.dp_size} "
                              f"needs {per_node} devices on this node: {exc}") from None


@dataclass
class Runtime:
    args: ServerArgs
    model_path: str
    ipc: IpcNames
    processes: list[Any]
    ready: SchedulerReady
    # The tokenizer this process loaded (None with --skip-tokenizer-init), shared with the detokenizer.
    tokenizer: Any = None
    # What each data-parallel replica loaded (``ready`` is replica 0's).
    replicas: list[SchedulerReady] = field(default_factory=list)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the engine processes: asks them over IPC (they ignore SIGTERM, which a supervisor
        sends the whole group), waits up to ``timeout`` s, then kills what is left."""
        if self.ready is None:
            timeout = 0.0  # still loading the model: it reads no messages until it is done
        else:
            _ask_to_stop(self.ipc, self.args.dp_size)
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self.ipc.remove()


def _ask_to_stop(ipc: IpcNames, dp_size: int = 1) -> None:
    """Sends ``ControlReq("shutdown")`` to every replica's scheduler and the detokenizer (never blocks)."""
    import zmq

    from engine.managers.io_struct import ControlReq

    ctx = zmq.Context()
    try:
        for endpoint in [*(ipc.replica_scheduler(i) for i in range(dp_size)), ipc.detokenizer]:
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


@dataclass
class StartingRuntime:
    """Child processes started, model still loading: do other start-up work, then ``wait_ready``."""

    args: ServerArgs
    model_path: str
    ipc: IpcNames
    processes: list[Any]
    # One per data-parallel replica: its scheduler writes ("ok", SchedulerReady) or ("error", message) here.
    ready_readers: list[Any]
    tokenizer_writer: Any  # this process sends the detokenizer its tokenizer (or None) here
    # The processes of each replica (``processes`` holds them all, then the detokenizer).
    replica_processes: list[list[Any]] = field(default_factory=list)

    def wait_ready(self) -> Runtime:
        """Loads the tokenizer while the scheduler loads the model, then waits for the model.

        The tokenizer is loaded once, here, and handed to the detokenizer, which so never
        imports what ``AutoTokenizer`` pulls in (torch among it), nor transformers at all for a
        tokenizer the ``tokenizers`` library decodes alone (``decode_only``). On failure stops
        the children and raises.
        """
        try:
            tokenizer = self._share_tokenizer()
            replicas = [_wait_ready(reader, procs, dp_rank, self.args.dp_size) for dp_rank, (reader, procs)
                        in enumerate(zip(self.ready_readers, self.replica_processes))]
        except BaseException:
            self.abort()
            raise
        finally:
            for reader in self.ready_readers:
                reader.close()
        runtime = Runtime(self.args, self.model_path, self.ipc, self.processes, replicas[0], tokenizer, replicas)
        _running[id(runtime)] = runtime
        return runtime

    def _share_tokenizer(self) -> Any:
        args = self.args
        tokenizer = None
        try:
            if not args.skip_tokenizer_init:
                from engine.managers.tokenizer_utils import load_tokenizer

                tokenizer = load_tokenizer(args.tokenizer_path or self.model_path, args.trust_remote_code)
            try:
                from engine.managers.decode_only import decoding_tokenizer

                # The tokenizers library's own object where it decodes alike: the detokenizer then
                # needs no transformers to unpickle it.
                self.tokenizer_writer.send(decoding_tokenizer(tokenizer))
            except Exception as exc:  # not picklable (remote code): the detokenizer loads its own
                logger.debug("tokenizer not shared with the detokenizer (%s)", exc)
                self.tokenizer_writer.send(None)
        finally:
            self.tokenizer_writer.close()
        return tokenizer

    def abort(self) -> None:
        self.tokenizer_writer.close()
        Runtime(self.args, self.model_path, self.ipc, self.processes, None).shutdown()  # type: ignore[arg-type]


def start_runtime(args: ServerArgs, model_path: str | None = None) -> StartingRuntime:
    """Starts the scheduler and detokenizer processes and returns while they load.

    The children are fresh interpreters (``child_process``), never importers of the user's
    ``__main__``; they start before this process's own checks so that their imports and the
    model load overlap with them. Under ``engine serve`` / ``engine generate`` on a CPU-only
    torch they are forks of this process instead, started once it has imported torch and
    transformers' config classes (``child_process.allow_forked_children``). ``model_path``: the
    checkpoint ``resolve_model_path`` already returned for ``args`` (None: resolved here).
    """
    from engine.cpu_threads import pool_env
    from engine.entrypoints.child_process import ChildProcess, forking_children, pipe
    from engine.preflight import check_split_from_config_json, check_without_checkpoint

    # Names, paths and the model's split are checked before any child starts or weight loads.
    check_without_checkpoint(args)
    if model_path is None:
        model_path = resolve_model_path(args)
    check_split_from_config_json(args, model_path)
    hf_config = None
    if forking_children():
        from engine.model_executor.checkpoint import load_hf_config

        # Forked children inherit what this process imported: torch and transformers' config
        # classes (seconds of CPU), which preflight needs below anyway, are imported once here.
        hf_config = load_hf_config(model_path, args.trust_remote_code)
        logger.info("engine processes start as forks of this one (CPU-only torch): they share its imports")
    ipc = IpcNames.create()
    parent_pid = os.getpid()
    tokenizer_writer, tokenizer_reader = pipe(to_child=True)
    readers: list[Any] = []
    replica_processes: list[list[Any]] = []
    processes: list[Any] = []
    # From here a failure or a signal (SIGTERM/SIGINT during start-up) stops whatever has
    # started and removes the IPC directory, wherever it lands.
    try:
        for dp_rank in range(args.dp_size):
            procs, reader = launch_replica(args, model_path, ipc.for_replica(dp_rank), dp_rank, parent_pid)
            readers.append(reader)
            replica_processes.append(procs)
            processes.extend(procs)
        # One thread: it decodes one request at a time (RAYON: the tokenizers library's own pool).
        processes.append(ChildProcess("engine.managers.detokenizer_manager:detokenizer_process",
                                      (args, model_path, ipc, parent_pid, tokenizer_reader), name="detokenizer",
                                      env={**pool_env(1), "RAYON_NUM_THREADS": "1"}))
        starting = StartingRuntime(args, model_path, ipc, processes, readers, tokenizer_writer, replica_processes)
        preflight(args, model_path, hf_config)
    except BaseException:
        StartingRuntime(args, model_path, ipc, processes, readers, tokenizer_writer, replica_processes).abort()
        for reader in readers:
            reader.close()
        raise
    return starting


def launch_replica(args: ServerArgs, model_path: str, ipc: IpcNames | None, dp_rank: int,
                   parent_pid: int) -> tuple[list[Any], Any]:
    """Starts this node's scheduler ranks of data-parallel replica ``dp_rank``.

    One process per tensor/pipeline rank (``--tp-size`` x ``--pp-size``, spread over
    ``--nnodes``); rank 0 binds ``ipc.scheduler``, the replica's own endpoint
    (``IpcNames.for_replica``), and alone sends outputs to the shared detokenizer and control
    replies to the tokenizer manager. ``ipc`` is None on nodes other than 0. On a GPU platform
    the replica's devices start at local device ``dp_rank`` x (ranks per node).

    Returns the replica's processes and one reader of their readiness (``ReplicaReady``: rank
    0's ``SchedulerReady`` once every rank is ready, or the first rank's error).
    """
    from engine.entrypoints.node_ranks import launch_ranks

    return launch_ranks(args, model_path, ipc, dp_rank, parent_pid)


def launch_runtime(args: ServerArgs, model_path: str | None = None) -> Runtime:
    """Starts the scheduler and detokenizer processes and waits until the model is loaded."""
    return start_runtime(args, model_path).wait_ready()


# Runtimes not yet shut down: stopped at interpreter exit, so a script that never calls
# Engine.shutdown() leaves no processes behind and exits at once.
_running: weakref.WeakValueDictionary[int, Runtime] = weakref.WeakValueDictionary()


@atexit.register
def _shutdown_running() -> None:
    for runtime in list(_running.values()):
        if any(proc.is_alive() for proc in runtime.processes):
            runtime.shutdown(timeout=2.0)


def _wait_ready(reader: Any, procs: list[Any], dp_rank: int = 0, dp_size: int = 1) -> SchedulerReady:
    where = f" of data-parallel replica {dp_rank}" if dp_size > 1 else ""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    dead = None
    while time.monotonic() < deadline:
        if reader.poll(0.2):
            try:
                status, payload = reader.recv()
            except EOFError:
                break
            if status == "ok":
                return payload
            raise EngineError(f"{payload}{' (data-parallel replica ' + str(dp_rank) + ')' if dp_size > 1 else ''}")
        dead = next((p for p in procs if not p.is_alive()), None)
        if dead is not None:
            break
    proc = dead or procs[0]
    raise EngineError(f"the scheduler process{where} exited during start-up (exit code {proc.exitcode}); see its log above")
