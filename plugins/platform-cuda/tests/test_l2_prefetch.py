"""``cuda.l2_prefetch_mb`` on the CPU: the option's checks, which weights the prefetcher pairs with
which layers, and that the platform adds nothing to a capture when the option is off or the GPU
lacks bulk prefetches. The kernel's code for sm_90 is checked in test_l2_prefetch_sm90_compile.py,
and what it does in a graph on the GPU in test_l2_prefetch_gpu.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from engine_platform_cuda.l2_prefetch import L2Prefetcher, largest_tensor, qkv_chain
from engine_platform_cuda.platform import CudaPlatform
from torch import nn

from engine.errors import ConfigError


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(8, 24)
        self.o_proj = nn.Linear(8, 8)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()
        self.mlp = nn.Linear(8, 8)


def _model(layers: int = 3) -> nn.Module:
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList(_Layer() for _ in range(layers))
    return root


@pytest.mark.parametrize("value", [-1, 65, True, "6", 2.5, "on"])
def test_option_names_the_field_the_value_and_the_range(value: object) -> None:
    with pytest.raises(ConfigError, match=r"cuda\.l2_prefetch_mb: invalid value .*accepted: auto or an int from 0 "
                                          r"\(off\) to 64"):
        CudaPlatform({"l2_prefetch_mb": value})


def test_option_defaults_to_auto_which_is_on_for_one_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.distributed as dist

    assert CudaPlatform().options["l2_prefetch_mb"] == "auto"
    assert CudaPlatform().l2_prefetch_plan() == (6, 8)  # 6 MiB in graphs of up to 8 tokens
    assert CudaPlatform({"l2_prefetch_mb": 0}).l2_prefetch_plan() == (0, None)
    monkeypatch.setattr(dist, "get_tensor_model_parallel_world_size", lambda: 2)
    assert CudaPlatform().l2_prefetch_plan() == (0, None)  # auto under TP: off
    assert CudaPlatform({"l2_prefetch_mb": 4}).l2_prefetch_plan() == (4, None)  # a number: every graph
    monkeypatch.setattr(dist, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(dist, "get_pipeline_model_parallel_world_size", lambda: 2)
    assert CudaPlatform().l2_prefetch_plan() == (0, None)


def test_the_chain_is_each_layers_qkv_projection_in_order() -> None:
    model = _model(3)
    chain = qkv_chain(model)
    assert chain == [layer.self_attn.qkv_proj for layer in model.model.layers]


def test_the_staged_tensor_is_the_modules_largest_own_one() -> None:
    linear = nn.Linear(8, 24)
    assert largest_tensor(linear) is linear.weight
    linear.register_buffer("qweight", torch.zeros(64, 64, dtype=torch.int32))  # a packed weight
    assert largest_tensor(linear) is linear.qweight
    assert largest_tensor(nn.ReLU()) is None


def test_graphs_of_more_tokens_than_max_rows_stage_nothing() -> None:
    """``auto``'s row limit: a qkv input of more rows returns before any staging work; one within
    it goes on to stage (which needs the GPU's side stream: the assertion on it fires here)."""
    model = _model()
    prefetcher = L2Prefetcher(model, 6, max_rows=8)  # CPU weights: no pairs, no hooks
    first = qkv_chain(model)[0]
    prefetcher.pairs = {id(first): first.weight}
    prefetcher.active = True
    prefetcher._after_qkv(first, (torch.zeros(9, 8),), None)
    assert prefetcher.forks == 0 and not prefetcher._forked
    with pytest.raises(AssertionError):
        prefetcher._after_qkv(first, (torch.zeros(8, 8),), None)
    # An RMSNorm folded into the projection: its rows count.
    from engine.layers.layernorm import PendingNorm

    rows9 = torch.zeros(9, 8)
    prefetcher._after_qkv(first, (PendingNorm(rows9, None, torch.ones(8), 1e-6, rows9, rows9),), None)
    assert prefetcher.forks == 0 and not prefetcher._forked


def test_no_capture_work_when_off_or_without_bulk_prefetch(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine_platform_cuda.l2_prefetch as l2

    model = _model()
    assert isinstance(CudaPlatform({"l2_prefetch_mb": 0}).decode_capture_context(model), contextlib.nullcontext)
    monkeypatch.setattr(l2, "supports_l2_prefetch", lambda device=None: False)
    assert isinstance(CudaPlatform({"l2_prefetch_mb": 6}).decode_capture_context(model), contextlib.nullcontext)
    assert isinstance(CudaPlatform().decode_capture_context(model), contextlib.nullcontext)
    assert not any(m._forward_hooks for m in qkv_chain(model))


def test_other_platforms_add_nothing_to_a_capture() -> None:
    from engine.platforms import Platform

    class _Bare(Platform):
        def is_available(self) -> bool:
            return False

        def distributed_backend(self) -> str:
            return "gloo"

        def memory_info(self, device: torch.device) -> tuple[int, int]:
            return 0, 0

        def default_attention_backend(self, available: object) -> str:
            return "torch_native"

    assert isinstance(_Bare().decode_capture_context(_model()), contextlib.nullcontext)
