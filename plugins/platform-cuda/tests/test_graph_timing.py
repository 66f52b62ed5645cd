"""engine_platform_cuda.graph_timing: refuses an empty call list; on a GPU, times captured calls."""

from __future__ import annotations

import pytest
import torch
from engine_platform_cuda.graph_timing import graph_median_us


def test_refuses_nothing_to_time() -> None:
    with pytest.raises(ValueError, match="graph_median_us: 0 calls, reps=20; accepted: at least one call"):
        graph_median_us([])
    with pytest.raises(ValueError, match="reps=0"):
        graph_median_us([lambda: None], reps=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_times_the_calls_of_one_graph() -> None:
    x = torch.zeros(1 << 20, device="cuda")
    done = []

    def add() -> None:
        done.append(1)
        x.add_(1.0)

    per_call = graph_median_us([add, add, add], reps=5)
    assert per_call > 0
    assert len(done) == 6  # once each before the capture, once each while capturing; replays run no Python
    torch.cuda.synchronize()
    assert float(x[0]) == 3 + 3 * (1 + 5)  # warm-up; the capture runs nothing; one replay, then 5 timed
