"""The small-batch expert kernels (``fused_moe_small_batch``) against the torch reference and the
grouped kernels, and ``fused_moe``'s choice between them.

On a CPU-only machine the kernels run in Triton's interpreter (float32/float16; the ``cpu`` case of
``triton_device``), on a GPU compiled (the ``cuda`` case, marked gpu, with a bf16 Qwen3-30B-A3B-like
shape and a CUDA graph replay as well). Shapes are odd on purpose: no tile divides 40 or 48.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.layers.moe.reference import fused_moe_reference
from engine.layers.moe.router import select_experts_reference

E, H, INTER = 6, 48, 40


def _case(device: str, tokens: int, top_k: int, dtype: torch.dtype, seed: int, experts: int = E,
          hidden: int = H, inter: int = INTER) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    x = torch.randn(tokens, hidden, generator=gen)
    w, ids = select_experts_reference(torch.randn(tokens, experts, generator=gen), top_k, True)
    return x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype), w.to(device), ids.to(device)


# top_k 3: the down launch's slot tile (4 lanes) has a lane that is no slot.
@pytest.mark.parametrize("tokens, top_k", [(1, 2), (1, 3), (1, 1), (3, 2)], ids=["one-top2", "one-top3", "one-top1",
                                                                               "three-tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(triton_device: str, tokens: int, top_k: int, dtype: torch.dtype) -> None:
    """Correct for any batch (three tokens: slots may share an expert), fast for one token."""
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, w, ids = _case(triton_device, tokens, top_k, dtype, seed=tokens * 10 + top_k)
    ours = fused_moe_small_batch(x, w13, w2, w, ids)
    ref = fused_moe_reference(x.float(), w13.float(), w2.float(), w, ids)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ours.shape == (tokens, H) and ours.dtype == dtype
    torch.testing.assert_close(ours.float(), ref, atol=tol, rtol=tol)


def test_equals_the_grouped_kernels_in_float32(triton_device: str) -> None:
    """Both paths round at the same points; in float32 they differ only by the order of the K sums."""
    from engine.layers.moe.fused_moe import fused_moe
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, w, ids = _case(triton_device, 1, 2, torch.float32, seed=3)
    grouped = fused_moe(x, w13, w2, w, ids, config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1,
                                                    "num_warps": 4, "num_stages": 1})
    torch.testing.assert_close(fused_moe_small_batch(x, w13, w2, w, ids), grouped, atol=1e-5, rtol=1e-5)


def test_slots_held_elsewhere_add_nothing(triton_device: str) -> None:
    """Expert-parallel ids: -1 (another rank's expert) contributes zero, the rest as the reference."""
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, w, _ = _case(triton_device, 1, 3, torch.float32, seed=4)
    ids = torch.tensor([[2, -1, 5]], dtype=torch.int32, device=triton_device)
    ours = fused_moe_small_batch(x, w13, w2, w, ids)
    keep = torch.tensor([[2, 5]], dtype=torch.int32, device=triton_device)
    ref = fused_moe_reference(x, w13, w2, w[:, [0, 2]], keep)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    all_elsewhere = torch.full((1, 3), -1, dtype=torch.int32, device=triton_device)
    assert fused_moe_small_batch(x, w13, w2, w, all_elsewhere).abs().max().item() == 0.0


def test_per_channel_scales(triton_device: str) -> None:
    """The fp8 layout (one scale per expert and output channel; float32 codes here, since the
    interpreter holds no fp8): scales applied to each launch's sums."""
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, w, ids = _case(triton_device, 1, 2, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    s13 = (torch.rand(E, 2 * INTER, generator=gen) + 0.5).to(triton_device)
    s2 = (torch.rand(E, H, generator=gen) + 0.5).to(triton_device)
    ours = fused_moe_small_batch(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2)
    ref = fused_moe_reference(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tiles", [{"UP_BLOCK_N": 4, "UP_BLOCK_K": 16, "DOWN_BLOCK_N": 2, "DOWN_BLOCK_K": 16},
                                   {"UP_BLOCK_N": 4, "UP_BLOCK_K": 16, "DOWN_BLOCK_N": 2, "DOWN_BLOCK_K": 16,
                                    "DOWN_AHEAD": 1},
                                   {"UP_BLOCK_N": 64, "UP_BLOCK_K": 64, "DOWN_BLOCK_N": 64, "DOWN_BLOCK_K": 64}],
                         ids=["many-k-steps", "many-k-steps-ahead", "one-tile"])
def test_tile_sizes_do_not_change_the_result(triton_device: str, tiles: dict[str, int]) -> None:
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, w, ids = _case(triton_device, 1, 2, torch.float32, seed=7)
    ref = fused_moe_reference(x, w13, w2, w, ids)
    torch.testing.assert_close(fused_moe_small_batch(x, w13, w2, w, ids, tiles=tiles), ref, atol=1e-4, rtol=1e-4)


def _shared_mlp(device: str, dtype: torch.dtype, chunks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * chunks * INTER, H, generator=gen) / H**0.5
    down = torch.randn(H, chunks * INTER, generator=gen) / (chunks * INTER)**0.5
    return gate_up.to(device, dtype), down.to(device, dtype)


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    g, u = (x @ gate_up.t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u) @ down.t()


# top_k 2 + 2 chunks fills the down launch's 4-lane slot tile; 3 + 2 leaves 3 lanes of 8 empty.
@pytest.mark.parametrize("tokens, top_k, chunks", [(1, 2, 2), (1, 3, 2), (2, 2, 1)],
                         ids=["one-top2-two-chunks", "one-top3-two-chunks", "two-tokens-one-chunk"])
def test_shared_experts_in_the_same_launches(triton_device: str, tokens: int, top_k: int, chunks: int) -> None:
    """Shared experts (one SwiGLU MLP of ``chunks * I`` features) as extra slots of the two launches:
    the routed result plus the MLP's, each rounded as separate layers round them."""
    from engine.layers.moe.small_batch import fused_moe_small_batch, shared_chunks

    x, w13, w2, w, ids = _case(triton_device, tokens, top_k, torch.float32, seed=30 + top_k)
    gate_up, down = _shared_mlp(triton_device, torch.float32, chunks, seed=31)
    assert shared_chunks(gate_up, down, w13) == chunks
    ours = fused_moe_small_batch(x, w13, w2, w, ids, shared=(gate_up, down))
    ref = fused_moe_reference(x, w13, w2, w, ids) + _swiglu(x, gate_up, down)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    held_elsewhere = torch.full_like(ids, -1)  # expert parallelism: the shared experts still run
    torch.testing.assert_close(fused_moe_small_batch(x, w13, w2, w, held_elsewhere, shared=(gate_up, down)),
                               _swiglu(x, gate_up, down), atol=1e-4, rtol=1e-4)


def test_shared_experts_that_do_not_split_are_refused(triton_device: str) -> None:
    from engine.layers.moe.small_batch import fused_moe_small_batch, shared_chunks

    x, w13, w2, w, ids = _case(triton_device, 1, 2, torch.float32, seed=32)
    gate_up, down = _shared_mlp(triton_device, torch.float32, 2, seed=33)
    odd_up, odd_down = gate_up[:-2], down[:, :-1]  # 2 * I - 1 features: not whole chunks
    assert shared_chunks(odd_up, odd_down, w13) == 0
    assert shared_chunks(gate_up.half(), down.half(), w13) == 0
    with pytest.raises(ValueError, match=r"fused_moe_small_batch: shared experts .*accepted"):
        fused_moe_small_batch(x, w13, w2, w, ids, shared=(odd_up, odd_down))


@pytest.mark.parametrize("shape,tile", [
    ((6 + 2, 2048, 1408), (128, 1)),  # DeepSeek-V2-Lite (6 routed + 2 shared slots): 11 steps of 128
    ((2, 4096, 14336), (512, 0)),  # Mixtral-8x7B: 28 steps of 512
    ((8, 2048, 768), (256, 0)),  # Qwen3-30B-A3B: 3 steps of 256
], ids=["deepseek-v2-lite", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_down_weights_a_step_ahead_only_in_long_loops_of_short_steps(shape: tuple[int, int, int],
                                                                     tile: tuple[int, int]) -> None:
    """``small_batch_tiles``: the down launch's step divides I, and loops of 8 or more steps of at
    most 128 columns request each step's weights one step ahead (``DOWN_AHEAD``)."""
    from engine.layers.moe.small_batch import small_batch_tiles

    tiles = small_batch_tiles(*shape)
    assert (tiles["DOWN_BLOCK_K"], tiles["DOWN_AHEAD"]) == tile, tiles


def test_bad_shapes_name_the_tensors() -> None:
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, w, ids = _case("cpu", 1, 2, torch.float32, seed=8)
    with pytest.raises(ValueError, match=r"fused_moe_small_batch: w13 .*w2 .*accepted"):
        fused_moe_small_batch(x, w13, w2[:, :, :-1], w, ids)
    with pytest.raises(ValueError, match="unit stride"):
        fused_moe_small_batch(x, w13, w2.transpose(1, 2).contiguous().transpose(1, 2), w, ids)


def test_fused_moe_takes_the_small_path_on_its_own_choice_only(triton_device: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One token and no tiles, blocks or activation given: the small-batch kernels; otherwise, or at
    two tokens of few experts, the grouped ones (which the existing tests pin with their tiles)."""
    import engine.layers.moe.fused_moe as fused_module
    from engine.layers.moe.small_batch import SMALL_BATCH_MAX_TOKENS, small_batch_applies

    taken: list[int] = []
    real = fused_module.fused_moe_small_batch
    monkeypatch.setattr(fused_module, "fused_moe_small_batch",
                        lambda x, *a, **k: taken.append(x.shape[0]) or real(x, *a, **k))
    assert SMALL_BATCH_MAX_TOKENS == 2 and small_batch_applies(1, 2, E) and small_batch_applies(1, 8, 8)
    assert small_batch_applies(2, 8, 128) and not small_batch_applies(2, 2, 8)  # Qwen3-30B-A3B; Mixtral
    assert not small_batch_applies(0, 2, E) and not small_batch_applies(3, 1, 128)
    for tokens in (1, 2):  # 2 tokens of top 2 of 6 experts: the grouped kernels
        x, w13, w2, w, ids = _case(triton_device, tokens, 2, torch.float32, seed=9)
        out = fused_module.fused_moe(x, w13, w2, w, ids)
        torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, w, ids), atol=1e-4, rtol=1e-4)
    assert taken == [1]
    x, w13, w2, w, ids = _case(triton_device, 1, 2, torch.float32, seed=10)
    fused_module.fused_moe(x, w13, w2, w, ids, act_fn=lambda gu: torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:])
    fused_module.fused_moe(x, w13, w2, w, ids, config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1,
                                                       "num_warps": 4, "num_stages": 1})
    assert taken == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_qwen3_moe_shape_bf16_against_grouped_and_in_a_graph(quant: str, replays_like_eager: Callable[..., None]) -> None:
    """128 experts, top 8, hidden 2048, intermediate 768 (Qwen3-30B-A3B): bf16 (or fp8 codes with
    per-channel scales) against the reference and the grouped kernels; a CUDA graph of router + the
    two launches replays bit-equal to eager calls on new inputs."""
    from engine.layers.moe.fused_moe import fused_moe, pick_blocks
    from engine.layers.moe.router import select_experts
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, w, ids = _case("cuda", 1, 8, torch.bfloat16, seed=11, experts=128, hidden=2048, inter=768)
    scales: dict[str, torch.Tensor] = {}
    if quant == "fp8":
        def q(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            s = t.float().abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            return (t.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s
        w13, scales["w13_scale"] = q(w13)
        w2, scales["w2_scale"] = q(w2)
    ours = fused_moe_small_batch(x, w13, w2, w, ids, **scales)
    ref = fused_moe_reference(x.float(), w13 if quant == "fp8" else w13.float(), w2 if quant == "fp8" else w2.float(),
                              w, ids, **scales)
    torch.testing.assert_close(ours.float(), ref, atol=3e-2, rtol=3e-2)
    grouped = fused_moe(x, w13, w2, w, ids, config=pick_blocks(8, 128), **scales)
    # Same rounding points; the K sums' order differs (fma lanes vs tensor-core tiles).
    torch.testing.assert_close(ours, grouped, atol=2e-2, rtol=2e-2)

    logits = torch.randn(1, 128, device="cuda")

    def step() -> torch.Tensor:
        wt, i = select_experts(logits, 8, True)
        return fused_moe(x, w13, w2, wt, i, **scales)

    replays_like_eager(step, [x, logits], seeds=(12, 13))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU with programmatic dependent launch (sm_90+)")
@pytest.mark.parametrize("tokens", [1, 2])
def test_pdl_launches_equal_plain_ones_in_a_graph(tokens: int, replays_like_eager: Callable[..., None]) -> None:
    """With ``pdl`` the router's top-k and gate/up wait, then trigger, and down reads the routing
    and its first weight tile before it waits: the graph of the three replays bit-equal to eager calls,
    and both equal the launches without PDL (Qwen3-30B-A3B shape, bf16)."""
    from engine.layers.moe.fused_moe import fused_moe
    from engine.layers.moe.router import select_experts

    x, w13, w2, _, _ = _case("cuda", tokens, 8, torch.bfloat16, seed=21, experts=128, hidden=2048, inter=768)
    logits = torch.randn(tokens, 128, device="cuda")

    def step(pdl: bool = True) -> torch.Tensor:
        wt, i = select_experts(logits, 8, True, pdl=pdl)
        return fused_moe(x, w13, w2, wt, i, pdl=pdl)

    torch.testing.assert_close(step(True), step(False), atol=0, rtol=0)
    replays_like_eager(step, [x, logits], seeds=(22, 23))
    torch.testing.assert_close(step(True), step(False), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU with programmatic dependent launch (sm_90+)")
@pytest.mark.parametrize("tokens", [1, 2])
def test_pdl_with_shared_experts_equals_plain_launches_in_a_graph(tokens: int,
                                                                 replays_like_eager: Callable[..., None]) -> None:
    """DeepSeek-V2-Lite shape (top 6 of 64, two shared chunks, bf16; the down launch's weights a
    step ahead): with ``pdl`` the graph of the three launches replays bit-equal to eager calls, and
    both equal the launches without PDL."""
    from engine.layers.moe.router import select_experts
    from engine.layers.moe.small_batch import fused_moe_small_batch

    x, w13, w2, _, _ = _case("cuda", tokens, 6, torch.bfloat16, seed=24, experts=64, hidden=2048, inter=1408)
    gen = torch.Generator().manual_seed(25)
    shared = ((torch.randn(4 * 1408, 2048, generator=gen) / 2048**0.5).to("cuda", torch.bfloat16),
              (torch.randn(2048, 2 * 1408, generator=gen) / 2816**0.5).to("cuda", torch.bfloat16))
    logits = torch.randn(tokens, 64, device="cuda")

    def step(pdl: bool = True) -> torch.Tensor:
        wt, i = select_experts(logits, 6, False, pdl=pdl)
        return fused_moe_small_batch(x, w13, w2, wt, i, pdl=pdl, shared=shared)

    torch.testing.assert_close(step(True), step(False), atol=0, rtol=0)
    replays_like_eager(step, [x, logits], seeds=(26, 27))
    torch.testing.assert_close(step(True), step(False), atol=0, rtol=0)
