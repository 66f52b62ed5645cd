"""IPC directories: named after the owning pid, and reclaimed once that process is gone."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.managers.process_utils import reclaim_stale_ipc_dirs


def test_stale_ipc_dirs_of_dead_servers_are_reclaimed(tmp_path: object) -> None:
    root = str(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = os.path.join(root, f"engine-ipc-{dead.pid}-abc")
    live = os.path.join(root, f"engine-ipc-{os.getpid()}-def")
    unrelated = os.path.join(root, "engine-ipc-notapid-x")
    for path in (stale, live, unrelated):
        os.makedirs(path)
    assert reclaim_stale_ipc_dirs(root) == [stale]
    assert not os.path.exists(stale) and os.path.isdir(live) and os.path.isdir(unrelated)
