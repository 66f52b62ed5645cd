"""Helpers shared by the engine's processes: IPC names, logging, orphan checks."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class IpcNames:
    """ZeroMQ endpoints in a private (0700) directory, one per receiving process."""

    directory: str
    scheduler: str  # scheduler PULL: requests, aborts, control
    detokenizer: str  # detokenizer PULL: BatchTokenIDOut
    tokenizer: str  # tokenizer manager PULL: BatchStrOut, control replies

    @classmethod
    def create(cls) -> IpcNames:
        directory = tempfile.mkdtemp(prefix="engine-ipc-")
        os.chmod(directory, 0o700)
        return cls(directory, f"ipc://{directory}/scheduler", f"ipc://{directory}/detokenizer",
                   f"ipc://{directory}/tokenizer")

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)


def setup_child_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"[%(asctime)s {name}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def exit_if_orphaned(parent_pid: int) -> None:
    """Ends this process when its parent is gone (no orphans after a crash or SIGKILL)."""
    if os.getppid() != parent_pid:
        os._exit(0)
