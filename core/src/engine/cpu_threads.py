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
# Where a process's cgroup CPU limit is: cgroup v2, then v1.
_CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
_CGROUP_V1_QUOTA = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"
_CGROUP_V1_PERIOD = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"


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


def cgroup_cpu_limit(v2_path: str = _CGROUP_V2_CPU_MAX, v1_quota_path: str = _CGROUP_V1_QUOTA,
                     v1_period_path: str = _CGROUP_V1_PERIOD) -> int | None:
    """The CPU quota of this process's cgroup in whole CPUs (rounded up), or None when there is
    none or it cannot be read."""
    try:
        with open(v2_path) as f:
            quota_text, _, period_text = f.read().strip().partition(" ")
        if quota_text == "max":
            return None
        return max(1, math.ceil(int(quota_text) / int(period_text or "100000")))
    except (OSError, ValueError):
        pass
    try:
        with open(v1_quota_path) as f:
            quota = int(f.read().strip())
        with open(v1_period_path) as f:
            period = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


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
