"""Helpers shared by the engine's processes: IPC names, logging, signals, orphan checks."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_IPC_PREFIX = "engine-ipc-"


@dataclass(frozen=True)
class IpcNames:
    """ZeroMQ endpoints in a private (0700) directory, one per receiving process.

    The directory's name carries the owning (main) process's pid, so a directory left
    by a process that was SIGKILLed can be recognised and reclaimed by the next start.
    """

    directory: str
    scheduler: str  # scheduler PULL: requests, aborts, control
    detokenizer: str  # detokenizer PULL: BatchTokenIDOut, shutdown
    tokenizer: str  # tokenizer manager PULL: BatchStrOut, control replies

    @classmethod
    def create(cls) -> IpcNames:
        reclaim_stale_ipc_dirs()
        directory = tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{os.getpid()}-")
        os.chmod(directory, 0o700)
        return cls(directory, f"ipc://{directory}/scheduler", f"ipc://{directory}/detokenizer",
                   f"ipc://{directory}/tokenizer")

    def replica_scheduler(self, dp_rank: int) -> str:
        """The endpoint data-parallel replica ``dp_rank`` receives on (replica 0: ``scheduler``)."""
        return self.scheduler if dp_rank == 0 else f"{self.scheduler}-dp{dp_rank}"

    def for_replica(self, dp_rank: int) -> IpcNames:
        """The names as replica ``dp_rank`` sees them: ``scheduler`` is its own endpoint."""
        return dataclasses.replace(self, scheduler=self.replica_scheduler(dp_rank))

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def reclaim_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Removes this user's IPC directories whose owning process no longer exists.

    The children remove the directory when they outlive their parent; this catches what
    a SIGKILL of the whole group (OOM killer, ``kill -9 -PGID``) leaves behind.
    """
    removed = []
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), f"{_IPC_PREFIX}*-*")):
        pid_text = os.path.basename(path)[len(_IPC_PREFIX):].split("-", 1)[0]
        try:
            if not pid_text.isdigit() or os.stat(path).st_uid != os.getuid() or _pid_alive(int(pid_text)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d stale IPC director%s of dead servers", len(removed), "y" if len(removed) == 1 else "ies")
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def setup_child_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"[%(asctime)s {name}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def ignore_group_signals() -> None:
    """An engine child leaves stopping to its parent.

    Ctrl-C, systemd, Docker and Kubernetes signal the whole process group; the main
    process drains its requests first and then tells the children to stop (a
    ``ControlReq("shutdown")``), or they notice it is gone (``exit_if_orphaned``).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def exit_if_orphaned(parent_pid: int, ipc: IpcNames | None = None) -> None:
    """Ends this process when its parent is gone (no orphans after a crash or SIGKILL).

    The parent removes the IPC directory on a normal exit; after a SIGKILL it cannot, so
    the orphaned child does.
    """
    if os.getppid() != parent_pid:
        if ipc is not None:
            ipc.remove()
        os._exit(0)
