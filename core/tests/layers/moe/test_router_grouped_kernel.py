"""The one-launch grouped top-k router against the torch one (``grouped_topk_reference``), and
``FusedMoE`` sending plain softmax top-k (DeepSeek-V2-Lite's "greedy") to the one-launch softmax
router. Runs on the GPU (marked gpu) and, without one, under Triton's interpreter (conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe import FusedMoE
from engine.layers.moe.router_grouped import GroupedTopK, grouped_topk_reference
from engine.layers.moe.router_grouped_kernel import grouped_topk_triton

ROUTINGS = {
    # DeepSeek-V2: softmax, groups ranked by their best expert, scaled; 20 experts a group (not 2^n).
    "v2": (GroupedTopK("softmax", 8, 3, "max", False, 16.0), 160, 6, False),
    # DeepSeek-V3: sigmoid, correction bias, groups by their two best, renormalised and scaled.
    "v3": (GroupedTopK("sigmoid", 8, 4, "top2_sum", True, 2.5), 256, 8, True),
    # One group, sigmoid with a bias (no group limit), 60 experts.
    "sigmoid_one_group": (GroupedTopK("sigmoid", 1, 1, "max", True, 1.0), 60, 4, True),
    # Every group eligible but softmax renormalised and scaled: not plain top-k.
    "all_groups_scaled": (GroupedTopK("softmax", 4, 4, "max", True, 2.0), 32, 3, False),
}


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_matches_torch_routing(triton_device: str, tokens: int, name: str) -> None:
    routing, experts, top_k, with_bias = ROUTINGS[name]
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.5 if with_bias else None
    weights, ids = grouped_topk_triton(logits.to(triton_device), top_k, routing,
                                       bias.to(triton_device) if bias is not None else None)
    ref_w, ref_ids = grouped_topk_reference(logits, top_k, routing, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    # Best first in both (topk sorts); ties have probability zero with these logits.
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-6, rtol=1e-5)


def test_group_limit_excludes_a_better_expert(triton_device: str) -> None:
    """The best expert overall sits in a group whose top-2 sum loses: it must not be chosen."""
    routing = GroupedTopK("sigmoid", 4, 2, "top2_sum", False, 1.0)
    logits = torch.full((1, 16), -4.0)
    logits[0, 0] = 6.0  # group 0: one very good expert, the rest poor
    logits[0, 4:6] = 3.0  # group 1: two good ones
    logits[0, 8:10] = 2.5  # group 2
    weights, ids = grouped_topk_triton(logits.to(triton_device), 2, routing)
    ref_w, ref_ids = grouped_topk_reference(logits, 2, routing)
    assert sorted(ids[0].tolist()) == sorted(ref_ids[0].tolist()) == [4, 5]
    torch.testing.assert_close(weights.cpu().sort().values, ref_w.sort().values)


def test_16_bit_strided_logits(triton_device: str) -> None:
    dtype = torch.bfloat16 if triton_device == "cuda" else torch.float16
    routing, experts, top_k, _ = ROUTINGS["v2"]
    # Distinct values in 16 bits (steps of 0.05 over [-4, 4]): random bf16 logits tie, and
    # torch.topk orders ties arbitrarily.
    gen = torch.Generator().manual_seed(2)
    wide = torch.stack([torch.randperm(experts + 9, generator=gen) for _ in range(5)]).float()
    wide = (wide * 0.05 - 4.0).to(dtype)
    logits = wide[:, 4:4 + experts]
    weights, ids = grouped_topk_triton(logits.to(triton_device), top_k, routing)
    ref_w, ref_ids = grouped_topk_reference(logits, top_k, routing)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-5, rtol=1e-5)


def test_plain_softmax_routing_takes_the_softmax_router(triton_path: list[tuple[str, object]]) -> None:
    """DeepSeek-V2-Lite's routing (softmax, one group, no scaling) runs the one-launch router and
    alignment, and its output equals the grouped torch routing's."""
    torch.manual_seed(0)
    routing = GroupedTopK("softmax", 1, 1, "max", False, 1.0)
    assert routing.is_softmax_topk and not GroupedTopK("softmax", 2, 1).is_softmax_topk
    moe = FusedMoE(16, 4, 32, 24, False, routing=routing, params_dtype=torch.float32)
    moe.w13_weight.data.normal_(0, 0.1)
    moe.w2_weight.data.normal_(0, 0.1)
    x = torch.randn(5, 32)  # 20 slots: route_and_align's decode sizes
    logits = torch.randn(5, 16)
    out = moe(x, logits)
    assert triton_path and triton_path[-1][1] is not None, "the routing did not take route_and_align"
    from engine.layers.moe.reference import fused_moe_reference

    weights, ids = grouped_topk_reference(logits, 4, routing)
    torch.testing.assert_close(out, fused_moe_reference(x, moe.w13_weight, moe.w2_weight, weights, ids),
                               atol=1e-4, rtol=1e-4)
