"""``scripts/bench_argmax.py`` on the CPU: its table row for a small vocabulary (the kernel in Triton's
interpreter, a stand-in timer counting the calls it is given) says the two agree and prints; without
a GPU the script stops with a message naming what it needs."""

from __future__ import annotations

import importlib.util
import os
import pathlib
from types import ModuleType

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU and Triton's interpreter is off (TRITON_INTERPRET=1 runs it on CPU)")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_argmax", ROOT / "scripts" / "bench_argmax.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_row_is_measured_checked_and_printed() -> None:
    bench = _script()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    row = bench.measure(2, 9000, torch.float32, device, calls=3, timer=lambda calls: float(len(calls)))
    assert row["same"] and row["torch_us"] == row["kernel_us"] == 3.0
    assert row["torch_host_us"] > 0 and row["kernel_host_us"] > 0
    lines = bench.format_table([row]).splitlines()
    assert len(lines) == 2 and lines[1].split()[:2] == ["2", "9000"] and lines[1].endswith("yes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_without_a_gpu_it_says_what_it_needs() -> None:
    with pytest.raises(SystemExit, match="bench_argmax: needs a CUDA GPU"):
        _script().main([])
