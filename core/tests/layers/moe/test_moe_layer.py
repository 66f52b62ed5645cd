"""``FusedMoE`` sharding and loading without process groups: the shards of every (tp, ep) layout
hold the right slices, and their partial outputs sum to the unsharded layer's output; the same
with the layer's kernel path (one launch for routing and alignment, then the fused kernel) run by
Triton's interpreter on the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.distributed import set_expert_parallel, set_tensor_model_parallel
from engine.layers.moe import (
    FusedMoE,
    UnquantizedFusedMoEMethod,
    expert_params_mapping,
    fused_moe_reference,
)
from engine.layers.moe.align import ExpertBlocks
from engine.layers.moe.router import select_experts_reference
from engine.layers.moe.small_batch import small_batch_applies

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


def test_activation_is_the_kernels_epilogue_by_default() -> None:
    """The platform's silu_and_mul is not taken (``use_kernels``): SiLU-and-mul is the gate/up
    launch's epilogue, so ``act_fn`` stays None unless a model sets another activation. The layer
    takes only the ``pdl`` flag."""
    layer = FusedMoE(E, TOP_K, H, INTER, renormalize=True, prefix="mlp.experts")
    assert layer.act_fn is None and layer.expert_blocks is None and layer.pdl is False
    layer.use_kernels({"silu_and_mul": lambda x: x, "pdl": True})
    assert layer.act_fn is None and layer.pdl is True
    layer.use_kernels({"silu_and_mul": lambda x: x})
    assert layer.pdl is False


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2), (4, 2)], ids=["one-rank", "tp2-ep2", "tp4-ep2"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_kernel_path_routes_and_aligns_in_one_step(triton_path: list[tuple[str, object]], tp: int, ep: int,
                                                   tokens: int) -> None:
    """The layer's decode path (``route_and_align`` with this rank's experts, its blocks handed to
    ``fused_moe``) sums over the shards to the torch layer's output; blocks do not outlive forward.
    At one token (``small_batch_applies``: 1-2 tokens) the router runs alone and ``fused_moe`` gets no blocks:
    its small-batch kernels need none."""
    gen = torch.Generator().manual_seed(tokens + 10 * tp)
    x = torch.randn(tokens, H, generator=gen)
    logits = torch.randn(tokens, E, generator=gen)
    whole = _reference_layer(x, logits)
    shards = [_layer(r, tp, ep) for r in range(tp)]
    out = sum(s(x, logits) for s in shards)
    torch.testing.assert_close(out, whole, atol=1e-4, rtol=1e-4)
    assert len(triton_path) == tp
    for (_, blocks), shard in zip(triton_path, shards, strict=True):
        if small_batch_applies(tokens, TOP_K, E):
            assert blocks is None
        else:
            assert isinstance(blocks, ExpertBlocks) and blocks.num_slots == tokens * TOP_K
        assert shard.expert_blocks is None


def test_quant_method_without_blocks_aligns_in_the_kernel(triton_path: list[tuple[str, object]]) -> None:
    """A quant method that does not declare ``takes_expert_blocks`` gets the routing alone."""

    class NoBlocks(UnquantizedFusedMoEMethod):
        takes_expert_blocks = False

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, H, generator=gen)
    logits = torch.randn(3, E, generator=gen)
    layer = _layer(0, 1, 1)
    layer.quant_method = NoBlocks()
    torch.testing.assert_close(layer(x, logits), _reference_layer(x, logits), atol=1e-4, rtol=1e-4)
    assert triton_path == [("blocks", None)]


def _reference_layer(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The single-rank layer's output through the torch reference (no kernel)."""
    layer = _layer(0, 1, 1)
    w, ids = select_experts_reference(logits, TOP_K, True)
    return fused_moe_reference(x, layer.w13_weight, layer.w2_weight, w, ids)
