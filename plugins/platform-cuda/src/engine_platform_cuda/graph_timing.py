"""Kernel timing for the CUDA benchmark scripts: calls captured in one CUDA graph, so what is timed
is what a decode step with graphs pays (launch gaps included, host overhead not). It lives in the
platform plugin because the core reaches no device API directly (core/tests/test_platforms.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def graph_median_us(calls: Sequence[Callable[[], Any]], reps: int = 20) -> float:
    """Median microseconds per call over ``reps`` replays of one CUDA graph holding ``calls`` in
    order. Each call runs once outside the capture first (Triton compiles, cuBLAS picks kernels),
    on a side stream as capture requires."""
    import torch

    if not calls or reps < 1:
        raise ValueError(f"graph_median_us: {len(calls)} calls, reps={reps}; accepted: at least one call, reps >= 1")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]
