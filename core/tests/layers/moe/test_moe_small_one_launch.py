"""The small-batch experts in one persistent launch (``small_one_launch``) against the reference and
the two-launch path.

Under Triton's interpreter the grid's programs run one after another (the first takes every ticket);
on a GPU (marked gpu) they run together, down tiles waiting on the gate/up tiles of other programs,
for the Qwen3-30B-A3B shape, inside CUDA graphs and with programmatic dependent launch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.layers.moe.reference import fused_moe_reference

from .test_moe_small_batch import _case

ONE = {"UP_BLOCK_N": 4, "UP_BLOCK_K": 16, "DOWN_BLOCK_N": 2, "DOWN_BLOCK_K": 16, "ONE_LAUNCH_PER_SM": 1}


def _counters_zero(device: str) -> bool:
    from engine.layers.moe.small_one_launch import sync_buffer

    return int(sync_buffer(torch.device(device)).abs().sum().item()) == 0


@pytest.mark.parametrize("tokens, top_k", [(1, 2), (1, 3), (3, 2)], ids=["one-top2", "one-top3", "three-tokens"])
@pytest.mark.parametrize("tiles", [ONE, {**ONE, "UP_BLOCK_N": 64, "UP_BLOCK_K": 64, "DOWN_BLOCK_N": 64,
                                         "DOWN_BLOCK_K": 64}], ids=["many-tiles", "one-tile-a-step"])
def test_matches_reference_and_leaves_the_counters_zero(triton_device: str, tokens: int, top_k: int,
                                                        tiles: dict[str, int]) -> None:
    """Any batch (three tokens: slots may share an expert, each token has its own counter); with
    several K steps a down tile loads its first step before its wait and the rest after."""
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, w, ids = _case(triton_device, tokens, top_k, torch.float32, seed=30 + tokens * 10 + top_k)
    ref = fused_moe_reference(x, w13, w2, w, ids)
    for _ in range(2):  # the second launch starts from the counters the first one zeroed
        torch.testing.assert_close(fused_moe_small_batch(x, w13, w2, w, ids, tiles=tiles), ref, atol=1e-4, rtol=1e-4)
        assert _counters_zero(triton_device)


def test_equals_the_two_launches_in_float32(triton_device: str) -> None:
    """Same tiles: the same sums in the same order as the two-launch path, so equal."""
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, w, ids = _case(triton_device, 1, 3, torch.float32, seed=41)
    two = {k: v for k, v in ONE.items() if k != "ONE_LAUNCH_PER_SM"}
    torch.testing.assert_close(fused_moe_small_batch(x, w13, w2, w, ids, tiles=ONE),
                               fused_moe_small_batch(x, w13, w2, w, ids, tiles=two), atol=0, rtol=0)


def test_slots_held_elsewhere_and_scales(triton_device: str) -> None:
    """Expert-parallel ids (-1 adds zero) and the fp8 layout's per-channel scales."""
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, w, _ = _case(triton_device, 1, 3, torch.float32, seed=42)
    ids = torch.tensor([[2, -1, 5]], dtype=torch.int32, device=triton_device)
    gen = torch.Generator().manual_seed(43)
    s13 = (torch.rand(w13.shape[0], w13.shape[1], generator=gen) + 0.5).to(triton_device)
    s2 = (torch.rand(w2.shape[0], w2.shape[1], generator=gen) + 0.5).to(triton_device)
    ours = fused_moe_small_batch(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, tiles=ONE)
    keep = torch.tensor([[2, 5]], dtype=torch.int32, device=triton_device)
    ref = fused_moe_reference(x, w13, w2, w[:, [0, 2]], keep, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert _counters_zero(triton_device)


def test_too_many_tokens_named() -> None:
    from engine.layers.moe.small_one_launch import ONE_LAUNCH_MAX_TOKENS, launch_experts_one_launch

    ids = torch.zeros(ONE_LAUNCH_MAX_TOKENS + 1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"{ONE_LAUNCH_MAX_TOKENS + 1} tokens; accepted: at most"):
        launch_experts_one_launch(torch.zeros(1, 4), torch.zeros(1, 8, 4), None, torch.zeros(1, 4, 4), None, ids,
                                  torch.zeros(ids.shape), torch.zeros(2, 4), torch.zeros(1, 4), ONE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU with programmatic dependent launch (sm_90+)")
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_qwen3_shape_in_a_graph(tokens: int, pdl: bool, replays_like_eager: Callable[..., None]) -> None:
    """128 experts, top 8, hidden 2048, intermediate 768, bf16, the grid as the engine launches it
    (many programs at once, down tiles waiting on other programs' gate/up tiles): equal to the two
    launches with the same tiles, and a CUDA graph of router + the launch replays bit-equal to eager
    calls on new inputs, the counters zero after every replay."""
    from engine.layers.moe.router import select_experts
    from engine.layers.moe.small_batch import fused_moe_small_batch, small_batch_tiles

    x, w13, w2, _, _ = _case("cuda", tokens, 8, torch.bfloat16, seed=44, experts=128, hidden=2048, inter=768)
    logits = torch.randn(tokens, 128, device="cuda")
    base = {k: v for k, v in small_batch_tiles(8, 2048, 768).items() if k != "ONE_LAUNCH_PER_SM"}
    one = {**base, "ONE_LAUNCH_PER_SM": 4}

    def step(tiles: dict[str, int] = one) -> torch.Tensor:
        wt, i = select_experts(logits, 8, True, pdl=pdl)
        return fused_moe_small_batch(x, w13, w2, wt, i, tiles=tiles, pdl=pdl)

    for _ in range(3):
        torch.testing.assert_close(step(one), step(base), atol=0, rtol=0)
    replays_like_eager(step, [x, logits], seeds=(45, 46))
    torch.cuda.synchronize()
    assert _counters_zero("cuda")
