"""``FusedMoE`` sharding and loading without process groups: the shards of every (tp, ep) layout
hold the right slices, and their partial outputs sum to the unsharded layer's output; the same
with the layer's kernel path (one launch for routing and alignment, then the fused kernel; at 1-2
tokens no routing launch, the expert launches route from the logits) run by Triton's interpreter
on the CPU."""

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
from engine.layers.moe.layer import PendingRouting
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
def test_kernel_path_routes_and_aligns_in_one_step(triton_path: list[dict[str, object]], tp: int, ep: int,
                                                   tokens: int) -> None:
    """The layer's decode path (``route_and_align`` with this rank's experts, its blocks handed to
    ``fused_moe``) sums over the shards to the torch layer's output; blocks do not outlive forward.
    At one token (``small_batch_applies``: 1-2 tokens) ``fused_moe`` gets no blocks and no topk
    tensors but the pending routing with this rank's expert range: its small-batch kernels route
    themselves and need no alignment."""
    gen = torch.Generator().manual_seed(tokens + 10 * tp)
    x = torch.randn(tokens, H, generator=gen)
    logits = torch.randn(tokens, E, generator=gen)
    whole = _reference_layer(x, logits)
    shards = [_layer(r, tp, ep) for r in range(tp)]
    out = sum(s(x, logits) for s in shards)
    torch.testing.assert_close(out, whole, atol=1e-4, rtol=1e-4)
    assert len(triton_path) == tp
    for call, shard in zip(triton_path, shards, strict=True):
        blocks, routing = call["blocks"], call["routing"]
        if small_batch_applies(tokens, TOP_K, E):
            assert blocks is None and not call["topk_ids"]
            assert isinstance(routing, PendingRouting) and routing.router_logits is logits
            assert (routing.expert_start, routing.num_local_experts) == (shard.expert_start, E // ep)
        else:
            assert isinstance(blocks, ExpertBlocks) and blocks.num_slots == tokens * TOP_K
            assert routing is None and call["topk_ids"]
        assert shard.expert_blocks is None and shard.pending_routing is None


def test_quant_method_without_blocks_aligns_in_the_kernel(triton_path: list[dict[str, object]]) -> None:
    """A quant method that does not declare ``takes_expert_blocks`` gets the routing alone."""

    class NoBlocks(UnquantizedFusedMoEMethod):
        takes_expert_blocks = False

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, H, generator=gen)
    logits = torch.randn(3, E, generator=gen)
    layer = _layer(0, 1, 1)
    layer.quant_method = NoBlocks()
    torch.testing.assert_close(layer(x, logits), _reference_layer(x, logits), atol=1e-4, rtol=1e-4)
    assert triton_path == [{"blocks": None, "routing": None, "topk_ids": True}]


def _no_top_k_launch(*args: object, **kwargs: object) -> None:
    raise AssertionError("select_experts ran: the top-k launch was not folded into the expert launches")


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2), (4, 2)], ids=["one-rank", "tp2-ep2", "tp4-ep2"])
def test_one_token_runs_no_top_k_launch(triton_path: list[dict[str, object]], monkeypatch: pytest.MonkeyPatch,
                                        tp: int, ep: int) -> None:
    """At one token the routing is the expert launches' own: ``select_experts`` (and so the top-k
    launch) never runs, and the shards (expert-parallel ranks mapping ids in the kernels) still sum
    to the torch layer's output."""
    import engine.layers.moe.layer as layer_module

    gen = torch.Generator().manual_seed(20 + tp)
    x = torch.randn(1, H, generator=gen)
    logits = torch.randn(1, E, generator=gen)
    whole = _reference_layer(x, logits)
    shards = [_layer(r, tp, ep) for r in range(tp)]
    monkeypatch.setattr(layer_module, "select_experts", _no_top_k_launch)
    out = sum(s(x, logits) for s in shards)
    torch.testing.assert_close(out, whole, atol=1e-4, rtol=1e-4)
    assert [c["routing"] is not None for c in triton_path] == [True] * tp


def test_two_tokens_of_many_experts_run_no_top_k_launch(triton_path: list[dict[str, object]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tokens where ``small_batch_applies`` (top 2 of 32: 16 * 2 <= 32), renormalisation off:
    no top-k launch either, and the torch layer's output."""
    import engine.layers.moe.layer as layer_module

    experts, top_k = 32, 2
    gen = torch.Generator().manual_seed(5)
    layer = FusedMoE(experts, top_k, H, INTER, renormalize=False, prefix="mlp.experts")
    layer.w13_weight.data.copy_(torch.randn(experts, 2 * INTER, H, generator=gen))
    layer.w2_weight.data.copy_(torch.randn(experts, H, INTER, generator=gen))
    x = torch.randn(2, H, generator=gen)
    logits = torch.randn(2, experts, generator=gen)
    w, ids = select_experts_reference(logits, top_k, False)
    ref = fused_moe_reference(x, layer.w13_weight, layer.w2_weight, w, ids)
    assert small_batch_applies(2, top_k, experts)
    monkeypatch.setattr(layer_module, "select_experts", _no_top_k_launch)
    torch.testing.assert_close(layer(x, logits), ref, atol=1e-4, rtol=1e-4)
    assert triton_path[0]["routing"] is not None and layer.pending_routing is None


def test_quant_method_without_router_logits_gets_tensors(triton_path: list[dict[str, object]]) -> None:
    """A quant method that does not declare ``takes_router_logits`` gets ``select_experts``' tensors
    at one token too (and no pending routing)."""

    class TopKOnly(UnquantizedFusedMoEMethod):
        takes_router_logits = False

        def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor | None,
                  topk_ids: torch.Tensor | None) -> torch.Tensor:
            assert topk_weights is not None and topk_ids is not None and layer.pending_routing is None
            return super().apply(layer, x, topk_weights, topk_ids)

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, H, generator=gen)
    logits = torch.randn(1, E, generator=gen)
    layer = _layer(0, 1, 1)
    layer.quant_method = TopKOnly()
    torch.testing.assert_close(layer(x, logits), _reference_layer(x, logits), atol=1e-4, rtol=1e-4)
    assert triton_path == [{"blocks": None, "routing": None, "topk_ids": True}]


def test_pending_routing_resolves_on_the_reference_path() -> None:
    """A method handed a pending routing where the kernels do not run (the torch reference)
    computes the routing itself: ``PendingRouting.resolve`` is ``select_experts`` plus the local ids."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, H, generator=gen)
    logits = torch.randn(2, E, generator=gen)
    rank1 = _layer(1, 2, 2)  # experts 2, 3
    rank1.pending_routing = PendingRouting(logits, TOP_K, True, rank1.expert_start, rank1.num_local_experts)
    w, ids = rank1.pending_routing.resolve()
    ref_w, ref_ids = select_experts_reference(logits, TOP_K, True)
    assert torch.equal(w, ref_w)
    assert torch.equal(ids, torch.where(ref_ids >= 2, ref_ids - 2, torch.full_like(ref_ids, -1)))
    out = rank1.quant_method.apply(rank1, x, None, None)
    torch.testing.assert_close(out, fused_moe_reference(x, rank1.w13_weight, rank1.w2_weight, w, ids))


def _reference_layer(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The single-rank layer's output through the torch reference (no kernel)."""
    layer = _layer(0, 1, 1)
    w, ids = select_experts_reference(logits, TOP_K, True)
    return fused_moe_reference(x, layer.w13_weight, layer.w2_weight, w, ids)
