"""The sparse MoE block routes through ``FusedMoE.forward_with_router``: where the platform offers
``router_topk`` and the post-attention norm was handed on (one token), the router's logits and the
routing come from that kernel, and the block's output (shared expert included) is the one the
router's own launch and the top-k give. On the CPU with PyTorch stand-ins for the platform's kernels
(the real ones: plugins/platform-cuda/tests/test_router_topk.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_models_moe.models import SparseMoeBlock
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from engine.layers.layernorm import PendingNorm
from engine.layers.moe.router import select_experts_reference

HIDDEN = 32


class _NormLinear:
    """``layer_kernels()['linear']`` with norm fusion: the norm as ``RMSNorm`` computes it, then ``F.linear``."""

    max_rows = 8
    norm_fusion = True

    def norm_linear(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = pending.x + pending.residual
        pending.res_sum.copy_(x)
        h = x.to(torch.float32)
        normed = pending.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + pending.eps)).to(x.dtype)
        pending.normed.copy_(normed)
        return F.linear(normed, weight, bias)


class _RouterTopK:
    """``layer_kernels()['router_topk']``: the norm-fused router then the torch routing; counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def takes(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> bool:
        return pending.x.shape[0] == 1

    def __call__(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.calls += 1
        logits = _NormLinear().norm_linear(pending, weight, bias)
        return (logits, *select_experts_reference(logits, top_k, renormalize))


CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=16, norm_topk_prob=True),
    "qwen2_moe": lambda: Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=16, shared_expert_intermediate_size=24),
    "mixtral": lambda: MixtralConfig(hidden_size=HIDDEN, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=16),
}


def _block(name: str, kernels: dict[str, Any]) -> SparseMoeBlock:
    block = SparseMoeBlock(CONFIGS[name](), None, "model.layers.0.mlp")
    gen = torch.Generator().manual_seed(0)
    for param in block.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    for module in block.modules():
        if callable(getattr(module, "use_kernels", None)):
            module.use_kernels(kernels)
    return block


def _pending(tokens: int) -> PendingNorm:
    gen = torch.Generator().manual_seed(tokens)
    x, residual = torch.randn(tokens, HIDDEN, generator=gen), torch.randn(tokens, HIDDEN, generator=gen)
    return PendingNorm(x, residual, 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen), 1e-6, torch.empty_like(x),
                       torch.empty_like(x))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_takes_the_one_launch_routing_at_one_token(name: str) -> None:
    router_topk = _RouterTopK()
    fused = _block(name, {"linear": _NormLinear(), "router_topk": router_topk})
    plain = _block(name, {"linear": _NormLinear()})
    for tokens, calls in ((1, 1), (2, 1)):  # two tokens: the kernel's takes says no
        got_in, want_in = _pending(tokens), _pending(tokens)
        got, want = fused(got_in), plain(want_in)
        assert router_topk.calls == calls
        assert torch.equal(got, want)
        assert torch.equal(got_in.normed, want_in.normed) and torch.equal(got_in.res_sum, want_in.res_sum)
