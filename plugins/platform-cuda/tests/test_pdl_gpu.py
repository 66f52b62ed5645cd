"""Programmatic dependent launch in the engine (GPU, sm_90+): greedy decoding of tiny models is the
same token for token with ``cuda.pdl`` on (the default) and off, CUDA graphs on, for a dense
(Llama) and an MoE (Qwen3-MoE) model. PDL changes when kernels start, never what they compute:
each kernel launched with it reads its predecessor's output only after ``griddepcontrol.wait``.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from engine.testing.checkpoints import DECODE_KERNEL_MODELS
from engine.testing.harness import generate_greedy, make_scheduler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a CUDA GPU of sm_90+")]

PROMPTS = [list(range(5, 10)), list(range(300, 317)), list(range(1000, 1040))]
MODELS = DECODE_KERNEL_MODELS


def _greedy(path: str, pdl: bool) -> list[list[int]]:
    sched = make_scheduler(path, platform="cuda", dtype="bfloat16", attention="triton", cuda_graph_max_bs=4,
                           plugin_options={"cuda": {"pdl": pdl}})
    linear = sched.runner.platform.layer_kernels()["linear"]
    assert linear.pdl is pdl
    # The model's layers hold that kernel (not only the platform): the runs differ in what they launch.
    taken = [m.skinny_linear for m in sched.runner.model.modules() if getattr(m, "skinny_linear", None) is not None]
    assert taken and all(k.pdl is pdl for k in taken)
    out = generate_greedy(sched, PROMPTS, 16, ignore_eos=True)
    del sched
    gc.collect()
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_is_the_same_with_and_without_pdl(name: str, tmp_path: Any) -> None:
    from engine.testing.checkpoints import make_tiny_checkpoint

    arch, cfg = MODELS[name]
    path = make_tiny_checkpoint(str(tmp_path), arch, dtype="bfloat16", seed=7, **cfg)
    assert _greedy(path, True) == _greedy(path, False)
