"""The MoE router's logits and top-k in one launch in the engine (GPU, sm_90+: it needs PDL): a tiny
Qwen3-MoE decodes the same greedy tokens with ``cuda.router_topk`` on (the default) and off, CUDA
graphs on, at batch 1 (where it runs) and 2 (where it does not), and the last-position logits of a
one-token prompt are equal, not close: the one launch gives the two launches' routing bit for bit.
It must run in the "on" engine and never in the "off" one.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from engine.testing.checkpoints import DECODE_KERNEL_MODELS
from engine.testing.harness import generate_greedy, last_position_logits, make_scheduler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a CUDA GPU of sm_90+")]

#: run as a batch of one, then of two: every decode step has 1 or 2 rows.
BATCHES = [[list(range(5, 10))], [list(range(300, 317)), list(range(1000, 1040))]]


def _run(path: str, on: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], torch.Tensor, int]:
    """Greedy outputs, the last-position logits of a one-token prompt, and how often the one launch
    was made from Python (capture included)."""
    import engine_platform_cuda.router_topk as router_topk

    calls = [0]
    real = router_topk.norm_router_topk

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(router_topk, "norm_router_topk", counting)  # what RouterTopK.__call__ calls
    sched = make_scheduler(path, platform="cuda", dtype="bfloat16", attention="triton", cuda_graph_max_bs=4,
                           plugin_options={"cuda": {"router_topk": on}})
    assert sched.runner.cuda_graph_runner is not None
    assert ("router_topk" in sched.runner.layer_kernels) is on
    out = [o for batch in BATCHES for o in generate_greedy(sched, batch, 16, ignore_eos=True)]
    logits = last_position_logits(sched, [[7]])
    del sched
    gc.collect()
    torch.cuda.empty_cache()
    return out, logits, calls[0]


def test_greedy_and_logits_equal_with_and_without_the_one_launch(tmp_path: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.testing.checkpoints import make_tiny_checkpoint

    arch, cfg = DECODE_KERNEL_MODELS["qwen3_moe"]
    path = make_tiny_checkpoint(str(tmp_path), arch, dtype="bfloat16", seed=7, **cfg)
    off, off_logits, off_calls = _run(path, False, monkeypatch)
    on, on_logits, on_calls = _run(path, True, monkeypatch)
    assert off_calls == 0 and on_calls > 0
    assert all(len(o) == 16 for o in off)
    assert on == off
    assert torch.equal(on_logits, off_logits)
