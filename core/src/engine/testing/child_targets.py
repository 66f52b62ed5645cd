"""Functions tests start as engine child processes (``engine.entrypoints.child_process``), which
import their target by module name."""

from __future__ import annotations

import os
from typing import Any


def report_thread_env(conn: Any) -> None:
    """Sizes torch's pools as a scheduler rank does (``limit_torch_threads_from_env``) and sends
    back the pool variables and the sizes torch then reports."""
    import torch

    from engine.cpu_threads import POOL_ENV_VARS, limit_torch_threads_from_env

    limit_torch_threads_from_env()
    report: dict[str, Any] = {name: os.environ.get(name) for name in POOL_ENV_VARS}
    report.update(torch_threads=torch.get_num_threads(), interop_threads=torch.get_num_interop_threads())
    conn.send(report)
    conn.close()
