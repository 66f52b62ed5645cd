"""``cuda.l2_prefetch_mb`` on the GPU (sm_90+). The prefetches ride a side stream inside each decode
graph and touch nothing a kernel reads or writes, so: a graph captured with them replays to the
same output as eager calls, with one prefetch launch a layer but the last; and greedy decoding of
tiny models (dense and MoE, CUDA graphs on) gives the same tokens with the option on and off."""

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


def _toy(layers: int) -> torch.nn.Module:
    """``model.layers.{i}.self_attn.qkv_proj`` (4 MiB bf16 weights: 256 chunks of 16 KiB) and an mlp."""
    torch.manual_seed(0)
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList()
    for _ in range(layers):
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.qkv_proj = torch.nn.Linear(1024, 2048, bias=False)
        layer.mlp = torch.nn.Linear(2048, 1024, bias=False)
        root.model.layers.append(layer)
    return root.to("cuda", torch.bfloat16)


def _forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in model.model.layers:
        x = layer.mlp(layer.self_attn.qkv_proj(x))
    return x


def test_a_graph_with_prefetches_replays_to_the_eager_output() -> None:
    from engine_platform_cuda.l2_prefetch import CHUNK_BYTES, L2Prefetcher, prefetch_to_l2

    model = _toy(3)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    eager = _forward(model, x)
    prefetcher = L2Prefetcher(model, mb=3)
    assert len(prefetcher.pairs) == 2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _forward(model, x)  # outside capture(): the hooks do nothing
    torch.cuda.current_stream().wait_stream(side)
    assert prefetcher.forks == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with prefetcher.capture():
            out = _forward(model, x)
    assert prefetcher.forks == 2 and not prefetcher.active
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    flag = torch.zeros(1024, dtype=torch.int32, device="cuda")
    weight = model.model.layers[1].self_attn.qkv_proj.weight
    assert prefetch_to_l2(weight, 3 * 2**20, flag) == 3 * 2**20
    assert prefetch_to_l2(weight, 64 * 2**20, flag) == weight.numel() * 2  # at most the tensor
    assert prefetch_to_l2(weight, CHUNK_BYTES - 1, flag) == 0
    torch.cuda.synchronize()
    assert not flag.any()  # never written
    prefetcher.remove()
    # A row limit (``auto``'s): a graph of more tokens is captured without staging.
    limited = L2Prefetcher(model, mb=3, max_rows=1)
    x2 = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        with limited.capture():
            out2 = _forward(model, x2)
    graph2.replay()
    torch.cuda.synchronize()
    assert limited.forks == 0 and torch.equal(out2, _forward(model, x2))
    limited.remove()


def _greedy(path: str, mb: int | str) -> tuple[list[list[int]], int]:
    sched = make_scheduler(path, platform="cuda", dtype="bfloat16", attention="triton", cuda_graph_max_bs=4,
                           plugin_options={"cuda": {"l2_prefetch_mb": mb}})
    platform = sched.runner.platform
    forks = sum(p.forks for p in platform._prefetchers.values())
    out = generate_greedy(sched, PROMPTS, 16, ignore_eos=True)
    del sched
    gc.collect()
    torch.cuda.empty_cache()
    return out, forks


@pytest.mark.parametrize("name", list(DECODE_KERNEL_MODELS))
def test_greedy_is_the_same_with_and_without_l2_prefetch(name: str, tmp_path: Any) -> None:
    from engine.testing.checkpoints import make_tiny_checkpoint

    arch, cfg = DECODE_KERNEL_MODELS[name]
    path = make_tiny_checkpoint(str(tmp_path), arch, dtype="bfloat16", seed=7, **cfg)
    on, forks = _greedy(path, 6)
    assert forks > 0  # the decode graphs were captured with prefetches in them
    off, none = _greedy(path, 0)
    assert none == 0 and on == off
    auto, auto_forks = _greedy(path, "auto")  # the default: 6 MiB on one GPU
    assert auto_forks == forks and auto == off
