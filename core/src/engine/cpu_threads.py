"""How many CPU threads each of the engine's processes computes with.

torch (with OpenMP, MKL and OpenBLAS below it) starts one compute thread per core in every
process that imports it. The server runs several processes on the same cores: the scheduler
ranks run the model, the main process runs the HTTP server and the tokenizer manager, the
detokenizer turns ids into text. Left alone, each would size its pool to the whole machine,
their threads would spin against each other's, and every decode step would wait for the
slowest. So:

- each scheduler rank gets ``compute_threads``: ``--cpu-threads``, else ``OMP_NUM_THREADS``
  when the user set it, else the cores this process may run on (its CPU affinity, bounded by
  its cgroup's CPU quota) less one for the other processes, split over the ranks on this node;
- the main process and the detokenizer compute with one thread each.

Nothing here imports torch at module level: the CLI reads it before torch is imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

# Variables the thread pools below torch read when they start.
POOL_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# Where the cgroup hierarchies are mounted, and where a process's own cgroups are named.
_CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_CGROUP = "/proc/self/cgroup"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, bounded by its cgroup's CPU quota
    (a container limited to 2 CPUs on a 64-core host gets 2)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def cgroup_cpu_limit(root: str = _CGROUP_ROOT, proc_cgroup: str = _PROC_CGROUP) -> int | None:
    """The CPU quota of this process's cgroup in whole CPUs (rounded up): the smallest quota set
    on its cgroup or any parent, cgroup v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``); None when none is set or nothing can be read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    v2_path, v1_path = "/", "/"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    limits = []
    for directory in _up_to(root, v2_path):
        quota, period = _read_pair(os.path.join(directory, "cpu.max"))
        if quota is not None:
            limits.append(math.ceil(quota / period))
    for controller in ("cpu", "cpu,cpuacct"):
        for directory in _up_to(os.path.join(root, controller), v1_path):
            quota, _ = _read_pair(os.path.join(directory, "cpu.cfs_quota_us"))
            period, _ = _read_pair(os.path.join(directory, "cpu.cfs_period_us"))
            if quota is not None and period:
                limits.append(math.ceil(quota / period))
    return max(1, min(limits)) if limits else None


def _up_to(root: str, path: str) -> list[str]:
    """``root``/``path`` and each parent directory up to ``root``."""
    parts = [p for p in path.split("/") if p and p != ".."]
    return [os.path.join(root, *parts[:n]) for n in range(len(parts), -1, -1)]


def _read_pair(path: str) -> tuple[int | None, int]:
    """A cgroup file's number and optional period (``"150000 100000"``; ``"max ..."`` and
    negative numbers mean no limit); (None, 0) when unset or unreadable."""
    try:
        with open(path) as f:
            first, _, second = f.read().strip().partition(" ")
        value = int(first)
        period = int(second) if second else 100000
    except (OSError, ValueError):
        return None, 0
    return (value, period) if value > 0 and period > 0 else (None, 0)


def compute_threads(cpu_threads: int | None, ranks_on_node: int = 1,
                    environ: Mapping[str, str] | None = None, cores: int | None = None) -> int:
    """Threads for each scheduler rank: ``cpu_threads`` (``--cpu-threads``) when given, else
    ``OMP_NUM_THREADS`` when set to a positive integer, else the usable cores less one (kept for
    the main process and the detokenizer) split over ``ranks_on_node``; at least 1."""
    if cpu_threads is not None:
        return max(1, cpu_threads)
    env = os.environ if environ is None else environ
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = usable_cores() if cores is None else cores
    return max(1, (cores - 1) // max(1, ranks_on_node))


def pool_env(threads: int) -> dict[str, str]:
    """Environment for a child process whose thread pools start with ``threads`` threads."""
    return {name: str(threads) for name in POOL_ENV_VARS}


def limit_torch_threads(threads: int) -> None:
    """Sizes this process's torch pools: ``threads`` intra-op threads, one inter-op thread.

    The inter-op pool can only be sized before its first use; a process that already used it
    keeps its size (nothing in the engine runs inter-op work).
    """
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def limit_torch_threads_from_env() -> None:
    """In a child started with ``pool_env``: sizes torch's pools to its ``OMP_NUM_THREADS``
    (torch reads that variable for its intra-op pool, not for the inter-op one)."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        limit_torch_threads(int(given))


__all__ = ["POOL_ENV_VARS", "cgroup_cpu_limit", "compute_threads", "limit_torch_threads",
           "limit_torch_threads_from_env", "pool_env", "usable_cores"]
