"""``engine.bench.kernel_times``: kernel time by name from a profiler run (the aten ops' CPU time
without a GPU) and its sum by class."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench.kernel_times import kernel_times, print_by_class


def test_cpu_run_gives_the_aten_ops_and_nothing_else() -> None:
    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a @ a
    times = kernel_times(prof, on_gpu=False)
    assert times and all(name.startswith("aten::") for name in times)
    assert times["aten::mm"] > 0
    assert kernel_times(prof, on_gpu=True) == {}  # no CUDA kernels in a CPU-only run


def test_by_class_sums_largest_first_with_shares(capsys: pytest.CaptureFixture[str]) -> None:
    times = {"gemm_a": 600.0, "gemm_b": 900.0, "norm": 500.0}
    print_by_class(times, lambda name: name.split("_")[0])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["gemm", "norm"]
    assert "1.500 ms" in lines[0] and "75.0%" in lines[0]
    assert "0.500 ms" in lines[1] and "25.0%" in lines[1]
    print_by_class(times, lambda name: "all", total=4000.0)
    assert "50.0%" in capsys.readouterr().out
