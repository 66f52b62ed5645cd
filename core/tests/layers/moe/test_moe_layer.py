"""``FusedMoE`` sharding and loading without process groups: the shards of every (tp, ep) layout
hold the right slices, and their partial outputs sum to the unsharded layer's output."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.distributed import set_expert_parallel, set_tensor_model_parallel
from engine.layers.moe import FusedMoE, expert_params_mapping

E, H, INTER, TOP_K = 4, 16, 8, 2


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    yield
    set_tensor_model_parallel(0, 1)
    set_expert_parallel(1)


def _checkpoint() -> dict[tuple[int, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ckpt = {}
    for e in range(E):
        ckpt[e, "w1"] = torch.randn(INTER, H, generator=gen)
        ckpt[e, "w3"] = torch.randn(INTER, H, generator=gen)
        ckpt[e, "w2"] = torch.randn(H, INTER, generator=gen)
    return ckpt


def _layer(tp_rank: int, tp: int, ep: int) -> FusedMoE:
    set_tensor_model_parallel(tp_rank, tp)
    set_expert_parallel(ep)
    layer = FusedMoE(E, TOP_K, H, INTER, renormalize=True, prefix="mlp.experts", reduce_results=False)
    for (e, shard), tensor in _checkpoint().items():
        param = layer.w2_weight if shard == "w2" else layer.w13_weight
        layer.weight_loader(param, tensor, e, shard)
    return layer


def test_mapping_names_every_expert_projection() -> None:
    mapping = expert_params_mapping(2, "w1", "w3", "w2")
    assert ("experts.w13_", "experts.1.w3.", 1, "w3") in mapping
    assert ("experts.w2_", "experts.0.w2.", 0, "w2") in mapping
    assert len(mapping) == 6


def test_single_rank_stacks_gate_then_up() -> None:
    layer = _layer(0, 1, 1)
    ckpt = _checkpoint()
    assert layer.w13_weight.shape == (E, 2 * INTER, H) and layer.w2_weight.shape == (E, H, INTER)
    torch.testing.assert_close(layer.w13_weight[2, :INTER], ckpt[2, "w1"])
    torch.testing.assert_close(layer.w13_weight[2, INTER:], ckpt[2, "w3"])


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2), (4, 2)], ids=["tp2", "tp2-ep2", "tp4-ep2"])
def test_shards_sum_to_the_whole(tp: int, ep: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, H, generator=gen)
    logits = torch.randn(5, E, generator=gen)
    whole = _layer(0, 1, 1)(x, logits)
    shards = [_layer(r, tp, ep) for r in range(tp)]
    assert shards[-1].num_local_experts == E // ep
    assert shards[-1].expert_start == (ep - 1) * E // ep
    assert shards[-1].w13_weight.shape == (E // ep, 2 * INTER * ep // tp, H)
    torch.testing.assert_close(sum(s(x, logits) for s in shards), whole, atol=1e-5, rtol=1e-5)


def test_use_kernels_hands_the_platform_activation_to_the_experts() -> None:
    layer = FusedMoE(E, TOP_K, H, INTER, renormalize=True, prefix="mlp.experts")
    assert layer.act_fn is None
    layer.use_kernels({"rms_norm": object()})  # a platform without a fused silu_and_mul
    assert layer.act_fn is None

    def fused(x: torch.Tensor) -> torch.Tensor:
        return x

    layer.use_kernels({"silu_and_mul": fused})
    assert layer.act_fn is fused
