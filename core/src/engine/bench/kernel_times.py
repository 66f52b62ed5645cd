"""Kernel time from a ``torch.profiler`` run, by kernel name and by class: what
``scripts/profile_decode.py`` and ``plugins-quant/fp8/benchmarks/profile_prefill.py`` print."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any


def kernel_times(prof: Any, on_gpu: bool) -> dict[str, float]:
    """Microseconds by kernel name of a finished ``torch.profiler.profile``: the CUDA kernels' self
    time, or on a run without a GPU (a dry run of a profiling script) the aten ops' CPU self time."""
    import torch

    out: dict[str, float] = collections.defaultdict(float)
    for evt in prof.key_averages():
        if on_gpu and evt.device_type == torch.autograd.DeviceType.CUDA:
            out[evt.key] += evt.self_device_time_total
        elif not on_gpu and evt.key.startswith("aten::"):
            out[evt.key] += evt.self_cpu_time_total
    return out


def print_by_class(times: dict[str, float], classify: Callable[[str], str], total: float | None = None,
                   width: int = 9, label_width: int = 22) -> None:
    """``times`` (microseconds by kernel name) summed by ``classify``'s class, largest first: one
    line each, milliseconds and the share of ``total`` (default: the sum of ``times``)."""
    total = sum(times.values()) if total is None else total
    groups: dict[str, float] = collections.defaultdict(float)
    for name, us in times.items():
        groups[classify(name)] += us
    for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {group:<{label_width}}{us / 1e3:{width}.3f} ms  {100 * us / max(total, 1e-9):5.1f}%")
