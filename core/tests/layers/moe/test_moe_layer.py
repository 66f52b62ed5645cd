"""``FusedMoE`` sharding and loading without process groups: the shards of every (tp, ep) layout
hold the right slices, and their partial outputs sum to the unsharded layer's output; the same
with the layer's kernel path (one launch for routing and alignment, then the fused kernel) run by
Triton's interpreter on the CPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.distributed import set_expert_parallel, set_tensor_model_parallel
from engine.layers.layernorm import PendingNorm, normed_tensor
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


# -- the router and its top-k in one launch (forward_with_router) -------------------------------

class _TorchNormLinear:
    """Stands for ``layer_kernels()['linear']`` with norm fusion: the norm as ``RMSNorm`` computes
    it, then ``F.linear`` (what the router layer runs on a ``PendingNorm``)."""

    max_rows = 8
    norm_fusion = True

    def norm_linear(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = pending.x if pending.residual is None else pending.x + pending.residual
        if pending.residual is not None:
            pending.res_sum.copy_(x)
        h = x.to(torch.float32)
        normed = pending.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + pending.eps)).to(x.dtype)
        pending.normed.copy_(normed)
        return torch.nn.functional.linear(normed, weight, bias)


class _TorchRouterTopK:
    """Stands for ``layer_kernels()['router_topk']``: the norm-fused router, then the torch routing
    (the two steps ``FusedMoE`` takes on the CPU), for one token; records its calls."""

    def __init__(self) -> None:
        self.linear = _TorchNormLinear()
        self.calls = 0

    def takes(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> bool:
        return pending.x.shape[0] == 1 and top_k <= weight.shape[0]

    def __call__(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.calls += 1
        logits = self.linear.norm_linear(pending, weight, bias)
        return (logits, *select_experts_reference(logits, top_k, renormalize))


def _router(kernel: _TorchRouterTopK | None = None) -> Any:
    from engine.layers.linear import ReplicatedLinear

    router = ReplicatedLinear(H, E, bias=False, prefix="mlp.gate")
    router.weight.data.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(5)))
    router.use_kernels({"linear": (kernel or _TorchRouterTopK()).linear})
    return router


def _pending_norm(tokens: int, seed: int) -> PendingNorm:
    gen = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(tokens, H, generator=gen), torch.randn(tokens, H, generator=gen)
    return PendingNorm(x, residual, 1.0 + 0.1 * torch.randn(H, generator=gen), 1e-6, torch.empty_like(x),
                       torch.empty_like(x))


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2), (4, 2)], ids=["one-rank", "tp2-ep2", "tp4-ep2"])
def test_router_kernel_routes_one_token_as_the_router_then_the_top_k(tp: int, ep: int) -> None:
    """With the platform's ``router_topk`` the layer hands it the router's one-token input and runs the
    experts on its routing (this rank's ids) and the norm output it filled: the shards sum to the
    layer that runs the router, then ``select_experts``; the residual sum is filled too."""
    kernel = _TorchRouterTopK()
    pending, plain = _pending_norm(1, seed=tp), _pending_norm(1, seed=tp)
    router = _router(kernel)
    want = _layer(0, 1, 1).forward_with_router(plain, router)  # no router_topk: the two steps
    shards = [_layer(r, tp, ep) for r in range(tp)]
    for shard in shards:
        shard.use_kernels({"router_topk": kernel})
    got = sum(s.forward_with_router(pending, router) for s in shards)
    assert kernel.calls == tp
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(pending.normed, plain.normed) and torch.equal(pending.res_sum, plain.res_sum)
    one = _layer(0, 1, 1)
    one.use_kernels({"router_topk": kernel})
    assert torch.equal(one.forward_with_router(_pending_norm(1, seed=tp), router), want)


def test_router_kernel_is_left_out_where_it_does_not_apply() -> None:
    """Two tokens (the kernel's ``takes``), a plain tensor (no norm handed on), a quantized router:
    the router's own launch, then ``forward``; the same output as without the kernel."""
    from engine.layers.quantization import LinearMethodBase

    kernel = _TorchRouterTopK()
    layer, router = _layer(0, 1, 1), _router(kernel)
    layer.use_kernels({"router_topk": kernel})
    two = _pending_norm(2, seed=1)
    torch.testing.assert_close(layer.forward_with_router(two, router),
                               _layer(0, 1, 1).forward_with_router(_pending_norm(2, seed=1), router))
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer.forward_with_router(x, router), layer(x, router(x)))

    class _Quantized(LinearMethodBase):
        def create_weights(self, *args: Any, **kwargs: Any) -> None:
            pass

        def apply(self, layer: torch.nn.Module, x: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
            return torch.nn.functional.linear(normed_tensor(x), layer.weight, bias)

    router.quant_method = _Quantized()
    one = _pending_norm(1, seed=3)
    one.normed.copy_(torch.randn(1, H, generator=torch.Generator().manual_seed(4)))
    layer.forward_with_router(one, router)
    assert kernel.calls == 0
