"""The fused MoE Triton kernel and the slot alignment against the torch reference.

Without a GPU the root conftest sets TRITON_INTERPRET=1, so the kernel runs in Triton's
interpreter on the CPU (float32/float16 only: the interpreter's bfloat16 is not faithful, see
plugins-quant/int8/tests/test_int8_kernels.py); tiny shapes and 16-wide tiles keep each case to
a few seconds. Routings cover experts that receive no token, a single token, every slot on one
expert, and slots held by another expert-parallel rank (``-1``).
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe.align import align_slots_by_expert, max_padded_slots
from engine.layers.moe.reference import fused_moe_reference
from engine.layers.moe.router import select_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, INTER, TOP_K = 4, 48, 40, 2  # 48, 40: no 32-wide K or N tile divides them
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=gen) / INTER**0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _routing(tokens: int, seed: int, experts: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    w, ids = select_experts(logits, TOP_K, renormalize=True)
    return w.to(DEVICE), ids.to(DEVICE)


def test_select_experts_softmax_topk() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]] and ids.dtype == torch.int32
    torch.testing.assert_close(w, probs[:, [1, 2]])
    w, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(1))


def test_align_groups_slots_by_expert_in_padded_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]], dtype=torch.int32)  # expert 1 and 3: no slot
    blocks = align_slots_by_expert(ids, 4, block_m=4)
    used = int(blocks.num_padded.item())
    sorted_ids = blocks.sorted_slot_ids.tolist()
    # expert 0: slots 1, 4 (+2 pads); expert 2: slots 0, 2, 5 (+1 pad); elsewhere: slot 3 (+3 pads)
    assert used == 12
    assert sorted_ids[:used] == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]
    assert blocks.block_expert_ids.tolist()[:3] == [0, 2, -1]
    assert len(sorted_ids) == max_padded_slots(6, 4, 4)


@pytest.mark.parametrize("tokens, seed", [(1, 0), (3, 1), (37, 2)], ids=["one-token", "few-tokens", "many-tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_matches_reference(tokens: int, seed: int, dtype: torch.dtype) -> None:
    from engine.layers.moe.fused_moe import fused_moe

    w13, w2 = _weights(dtype, seed)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed + 10)).to(DEVICE, dtype)
    topk_w, topk_ids = _routing(tokens, seed)
    ours = fused_moe(x, w13, w2, topk_w, topk_ids, config=SMALL_TILES)
    ref = fused_moe_reference(x.float(), w13.float(), w2.float(), topk_w, topk_ids)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref, atol=tol, rtol=tol)


def test_decode_tier_with_an_expert_over_two_blocks() -> None:
    """``pick_blocks``' decode tier as launched (16-row blocks in grouped order, ``GROUP_M`` 8, more
    than there are row blocks): expert 0 takes all 24 tokens, so its slots span two blocks that run
    as neighbouring programs; the result is the reference's."""
    from engine.layers.moe.fused_moe import fused_moe, pick_blocks

    tokens = 24
    cfg = pick_blocks(tokens * TOP_K, E)
    assert cfg["BLOCK_M"] == 16 and cfg["GROUP_M"] > 1
    w13, w2 = _weights(torch.float32, 3)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    ids = torch.stack([torch.zeros(tokens, dtype=torch.int32), torch.arange(tokens, dtype=torch.int32) % 3 + 1], 1)
    topk_w = torch.rand(tokens, TOP_K, generator=torch.Generator().manual_seed(14))
    ours = fused_moe(x, w13, w2, topk_w.to(DEVICE), ids.to(DEVICE), config=cfg)
    ref = fused_moe_reference(x, w13, w2, topk_w.to(DEVICE), ids.to(DEVICE))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("experts", [8, 128], ids=["mixtral", "qwen3-moe"])
def test_pick_blocks_tiers_by_slots_an_expert(experts: int) -> None:
    """Up to 12 slots an expert the 16-row decode tier (in grouped order: an expert spilling into a
    second block reads its weights from L2 then), to 64 the 64-row tier, then the prefill tier."""
    from engine.layers.moe.fused_moe import pick_blocks

    decode = pick_blocks(12 * experts, experts)
    assert pick_blocks(1, experts) == decode
    assert decode["BLOCK_M"] == 16 and decode["GROUP_M"] == 8
    assert pick_blocks(12 * experts + 1, experts)["BLOCK_M"] == 64
    assert pick_blocks(64 * experts, experts)["BLOCK_M"] == 64
    assert pick_blocks(64 * experts + 1, experts)["BLOCK_M"] == 128


def test_fused_moe_empty_experts_and_other_ranks_slots() -> None:
    """Every token on expert 1 or held elsewhere (-1): experts 0, 2, 3 get nothing."""
    from engine.layers.moe.fused_moe import fused_moe

    w13, w2 = _weights(torch.float32, 3)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    topk_ids = torch.tensor([[1, -1]] * 5, dtype=torch.int32, device=DEVICE)
    topk_w = torch.full((5, 2), 0.5, device=DEVICE)
    ours = fused_moe(x, w13, w2, topk_w, topk_ids, config=SMALL_TILES)
    ref = fused_moe_reference(x, w13, w2, topk_w, topk_ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # Slots held elsewhere add nothing: half of expert 1's output.
    only = fused_moe_reference(x, w13, w2, torch.ones(5, 1, device=DEVICE), topk_ids[:, :1])
    torch.testing.assert_close(ours, 0.5 * only, atol=1e-4, rtol=1e-4)


def test_fused_moe_fp8_codes_with_per_channel_scales() -> None:
    """Weight codes with one scale per expert and output channel (the fp8 path's layout; float16
    codes here, since the interpreter cannot hold fp8): the kernel converts and scales as it loads."""
    from engine.layers.moe.fused_moe import fused_moe

    w13, w2 = _weights(torch.float32, 5)
    s13 = torch.rand(E, 2 * INTER, generator=torch.Generator().manual_seed(6)).to(DEVICE) + 0.5
    s2 = torch.rand(E, H, generator=torch.Generator().manual_seed(7)).to(DEVICE) + 0.5
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    topk_w, topk_ids = _routing(6, 9)
    ours = fused_moe(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, config=SMALL_TILES)
    ref = fused_moe_reference(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_fused_moe_uses_the_platform_activation_kernel() -> None:
    """``act_fn`` (the platform's fused ``silu_and_mul``, handed over by ``FusedMoE.use_kernels``)
    replaces the torch activation between the two grouped GEMMs."""
    from engine.layers.moe.fused_moe import fused_moe

    w13, w2 = _weights(torch.float32, 15)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(16)).to(DEVICE)
    topk_w, topk_ids = select_experts(torch.randn(3, E, generator=torch.Generator().manual_seed(17)).to(DEVICE), 2, True)
    calls = []

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(gate_up.shape))
        inter = gate_up.shape[1] // 2
        return torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    ours = fused_moe(x, w13, w2, topk_w, topk_ids, config=SMALL_TILES, act_fn=act)
    assert calls == [(6, w13.shape[1])]
    torch.testing.assert_close(ours, fused_moe_reference(x, w13, w2, topk_w, topk_ids), atol=1e-4, rtol=1e-4)


def test_fused_moe_top_1_skips_the_sum() -> None:
    from engine.layers.moe.fused_moe import fused_moe

    w13, w2 = _weights(torch.float32, 13)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    topk_ids = torch.tensor([[3], [0], [3], [1]], dtype=torch.int32, device=DEVICE)
    topk_w = torch.rand(4, 1, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    ours = fused_moe(x, w13, w2, topk_w, topk_ids, config=SMALL_TILES)
    assert ours.shape == (4, H)
    torch.testing.assert_close(ours, fused_moe_reference(x, w13, w2, topk_w, topk_ids), atol=1e-4, rtol=1e-4)


def test_padded_length_follows_the_slots_at_decode() -> None:
    """At most min(E + 1, slots) groups get a slot, so a batch-1 step of top 8 over 128 experts
    needs 8 blocks, not 129; every routing, the worst included, fits."""
    assert max_padded_slots(8, 128, 16) == 128
    assert max_padded_slots(512, 128, 16) == -(-(512 + 129 * 15) // 16) * 16
    gen = torch.Generator().manual_seed(0)
    for tokens, top_k, experts in [(1, 8, 128), (2, 4, 3), (4, 2, 16), (16, 8, 8)]:
        worst = torch.arange(tokens * top_k, dtype=torch.int32).reshape(tokens, top_k) % (experts + 1) - 1
        rand = torch.randint(-1, experts, (tokens, top_k), generator=gen, dtype=torch.int32)
        for ids in (worst, rand):
            blocks = align_slots_by_expert(ids, experts, 16)  # the torch version: scatter_ past the end raises
            assert int(blocks.num_padded.item()) <= blocks.sorted_slot_ids.numel() == max_padded_slots(
                tokens * top_k, experts, 16)


@pytest.mark.parametrize("tokens, top_k", [(1, 8), (5, 3), (33, 2)])
def test_sum_top_k_adds_each_tokens_rows(tokens: int, top_k: int) -> None:
    from engine.layers.moe.fused_moe import sum_top_k

    y = torch.randn(tokens * top_k, 1100, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)  # 3 blocks of 512
    torch.testing.assert_close(sum_top_k(y, tokens, top_k), y.view(tokens, top_k, -1).sum(1), atol=1e-5, rtol=1e-5)
    y16 = y.half()
    torch.testing.assert_close(sum_top_k(y16, tokens, top_k).float(), y16.float().view(tokens, top_k, -1).sum(1),
                               atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match=r"y of shape \(.*\); accepted: contiguous"):
        sum_top_k(y[:-1], tokens, top_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_epilogue_equals_the_separate_activation(dtype: torch.dtype) -> None:
    """The gate/up launch's SiLU-and-mul epilogue rounds where ``F.silu(g) * u`` on a stored
    ``[slots, 2I]`` rounds. Under the interpreter both paths' GEMMs add in the same order, so the
    16-bit results are equal (a missing rounding after the SiLU shows as ~1e-3); compiled, the
    two tile widths may leave the accumulators a bit apart."""
    from engine.layers.moe.fused_moe import fused_moe

    w13, w2 = _weights(dtype, 21)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(22)).to(DEVICE, dtype)
    topk_w, topk_ids = _routing(9, 23)

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]

    fused = fused_moe(x, w13, w2, topk_w, topk_ids, config=SMALL_TILES)
    separate = fused_moe(x, w13, w2, topk_w, topk_ids, config=SMALL_TILES, act_fn=act)
    tol = 1e-5 if dtype == torch.float32 else 0.0 if DEVICE == "cpu" else 2e-3
    torch.testing.assert_close(fused, separate, atol=tol, rtol=tol)


def test_fp8_codes_through_the_separate_activation() -> None:
    """Scaled codes with an ``act_fn`` (the gate/up launch writing both halves, scaled)."""
    from engine.layers.moe.fused_moe import fused_moe

    w13, w2 = _weights(torch.float32, 25)
    s13 = torch.rand(E, 2 * INTER, generator=torch.Generator().manual_seed(26)).to(DEVICE) + 0.5
    s2 = torch.rand(E, H, generator=torch.Generator().manual_seed(27)).to(DEVICE) + 0.5
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(28)).to(DEVICE)
    topk_w, topk_ids = _routing(1, 29)

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]

    ours = fused_moe(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, config=SMALL_TILES, act_fn=act)
    ref = fused_moe_reference(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens", [1, 6])
def test_blocks_from_the_router_launch(tokens: int) -> None:
    """``fused_moe(blocks=...)`` with ``route_and_align``'s blocks (this rank holding experts 1..3
    of 5: the others' slots are -1) equals the reference; blocks of another tile height are refused."""
    from engine.layers.moe.fused_moe import fused_moe
    from engine.layers.moe.route_align import route_and_align

    w13, w2 = _weights(torch.float32, 30)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(31)).to(DEVICE)
    logits = torch.randn(tokens, 5, generator=torch.Generator().manual_seed(32)).to(DEVICE)
    topk_w, topk_ids, blocks = route_and_align(logits, TOP_K, True, SMALL_TILES["BLOCK_M"], 1, 3)
    ours = fused_moe(x, w13[:3], w2[:3], topk_w, topk_ids, config=SMALL_TILES, blocks=blocks)
    torch.testing.assert_close(ours, fused_moe_reference(x, w13[:3], w2[:3], topk_w, topk_ids), atol=1e-4, rtol=1e-4)
    _, _, other = route_and_align(logits, TOP_K, True, 32, 1, 3)
    with pytest.raises(ValueError, match="blocks of .* slots by 32 do not fit this call"):
        fused_moe(x, w13[:3], w2[:3], topk_w, topk_ids, config=SMALL_TILES, blocks=other)
