"""Starting the scheduler ranks of one replica on this node, and watching them.

Rank 0 (node 0) talks to the tokenizer manager over IPC; the others get their work from it over
torch.distributed. Each rank reports readiness on its own pipe; ``ReplicaReady`` reads them as
one. Which ranks run here, on which devices, is ``engine.distributed.ranks``'s.
"""

from __future__ import annotations

import logging
import signal
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from engine.distributed.ranks import dp_attention_init_method, init_method, node_placements, rank_name

if TYPE_CHECKING:
    from engine.config import ServerArgs
    from engine.managers.process_utils import IpcNames

logger = logging.getLogger(__name__)


def launch_ranks(args: ServerArgs, model_path: str, ipc: IpcNames | None, dp_rank: int,
                 parent_pid: int) -> tuple[list[Any], ReplicaReady]:
    """Starts this node's scheduler ranks of replica ``dp_rank``.

    ``ipc`` is the replica's endpoints on node 0, None on the other nodes (their ranks talk only
    to the other ranks). Returns the processes (rank order) and their readiness as one reader.
    """
    from engine.cpu_threads import compute_threads, pool_env, usable_cores
    from engine.entrypoints.child_process import ChildProcess, pipe
    from engine.errors import ConfigError

    if ipc is not None and args.node_rank > 0:
        raise ConfigError(f"--node-rank: invalid value {args.node_rank} here; the server and the offline Engine "
                          "run on node 0; start the other nodes with `engine serve --node-rank N`, which runs "
                          "only their ranks")
    if getattr(args, "enable_dp_attention", False):
        method = dp_attention_init_method(args)
    elif args.nnodes > 1 or args.tp_size * args.pp_size > 1:
        method = init_method(args, dp_rank)
    else:
        method = ""
    processes, readers = [], []
    placements = list(node_placements(args, dp_rank, method))
    # The ranks of every replica on this node share its cores (replicas start one by one).
    ranks_here = len(placements) * (args.dp_size if ipc is not None else 1)
    threads = compute_threads(args.cpu_threads, ranks_here)
    if dp_rank == 0:
        logger.info("CPU threads: %d for each of the %d scheduler rank(s) here, 1 for the detokenizer and 1 "
                    "for the main process (%d usable cores; --cpu-threads or OMP_NUM_THREADS set it)",
                    threads, ranks_here, usable_cores())
    try:
        for placement in placements:
            reader, writer = pipe()
            readers.append(reader)
            rank_ipc = ipc if placement.rank == 0 else None
            processes.append(ChildProcess("engine.managers.scheduler_process:scheduler_process",
                                          (args, model_path, rank_ipc, writer, parent_pid, dp_rank, placement),
                                          name=rank_name(dp_rank, args, placement), env=pool_env(threads)))
    except BaseException:
        for proc in processes:
            proc.kill()
        raise
    return processes, ReplicaReady(readers, processes)


class ReplicaReady:
    """Several ranks' readiness pipes read as one, like the single scheduler's pipe.

    ``recv()`` gives the first ``("error", message)`` any rank sends, or, once every rank said
    ``("ok", info)``, the first rank's ``("ok", info)``. A rank that exits without a word makes
    ``recv()`` raise ``EOFError`` (the caller then reports the dead process).
    """

    def __init__(self, readers: list[Connection], processes: list[Any]) -> None:
        self.readers = readers
        self.processes = processes
        self._pending = dict(enumerate(readers))
        self._ok: dict[int, Any] = {}
        self._result: tuple[str, Any] | None = None
        self._eof = False

    def poll(self, timeout: float = 0.0) -> bool:
        deadline = time.monotonic() + timeout
        while self._result is None and not self._eof:
            left = deadline - time.monotonic()
            ready = wait(list(self._pending.values()), max(0.0, left)) if self._pending else []
            for conn in ready:
                index = next(i for i, c in self._pending.items() if c is conn)
                try:
                    status, payload = conn.recv()
                except EOFError:
                    self._eof = True
                    break
                del self._pending[index]
                if status != "ok":
                    where = self.processes[index].name if len(self.readers) > 1 else ""
                    self._result = (status, f"{where}: {payload}" if where and where not in str(payload) else payload)
                    break
                self._ok[index] = payload
            if not self._pending and self._result is None:
                self._result = ("ok", self._ok[min(self._ok)])
            if left <= 0 or not ready:
                break
        return self._result is not None or self._eof

    def recv(self) -> tuple[str, Any]:
        if self._result is None and not self._eof:
            self.poll(3600.0)
        if self._result is None:
            raise EOFError
        return self._result

    def close(self) -> None:
        for conn in self.readers:
            conn.close()


def watch_node_ranks(processes: list[Any], ready: ReplicaReady, node_rank: int) -> int:
    """A node other than 0: waits for its ranks to be ready, then until they exit.

    Returns the exit code: 0 when every rank stopped cleanly (the server on node 0 stopped
    them), 1 when one failed, in which case the others are killed (no rank is left hanging).
    """
    stopping = False

    def on_signal(sig: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    announced = False
    try:
        while True:
            if not announced and ready.poll(0.0):
                try:
                    status, payload = ready.recv()
                except EOFError:
                    status, payload = "error", None
                if status != "ok":
                    if payload:
                        logger.error("node %d: %s", node_rank, payload)
                    return _stop_all(processes, 1)
                logger.info("node %d: %d rank(s) ready; serving for node 0", node_rank, len(processes))
                announced = True
            if stopping:
                logger.info("node %d: stopping on a signal", node_rank)
                return _stop_all(processes, 0)
            dead = [p for p in processes if not p.is_alive()]
            if dead:
                bad = [p for p in dead if p.exitcode != 0]
                if bad:
                    logger.error("node %d: engine process '%s' exited (exit code %s); stopping this node's ranks",
                                 node_rank, bad[0].name, bad[0].exitcode)
                    return _stop_all(processes, 1)
                if len(dead) == len(processes):
                    logger.info("node %d: the server stopped; every rank exited", node_rank)
                    return 0
            time.sleep(0.25)
    finally:
        ready.close()


def _stop_all(processes: list[Any], code: int) -> int:
    for proc in processes:
        proc.kill()
    for proc in processes:
        proc.join(2.0)
    return code
