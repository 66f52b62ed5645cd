"""The one-launch expert kernel (``fused_moe_one_launch``) against the torch reference, its
fixed-point sums (order-free, workspace left zeroed, overflow made visible), and ``fused_moe`` /
``FusedMoE`` taking it.

On a CPU-only machine the kernel runs in Triton's interpreter (the ``cpu`` case of
``triton_device``), on a GPU compiled (the ``cuda`` case, marked gpu, plus a bf16 and fp8
Qwen3-30B-A3B-shaped case with a CUDA graph and programmatic dependent launch). Shapes are odd on
purpose: no tile divides 40 or 48.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.layers.moe.reference import fused_moe_reference
from engine.layers.moe.router import select_experts_reference

E, H, INTER = 6, 48, 40
SMALL_TILES = {"BLOCK_I": 16, "BLOCK_K": 32, "BLOCK_H": 32}


def _case(device: str, tokens: int, top_k: int, dtype: torch.dtype, seed: int, experts: int = E,
          hidden: int = H, inter: int = INTER) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    x = torch.randn(tokens, hidden, generator=gen)
    w, ids = select_experts_reference(torch.randn(tokens, experts, generator=gen), top_k, True)
    return x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype), w.to(device), ids.to(device)


@pytest.mark.parametrize("tokens, top_k", [(1, 2), (1, 3), (1, 1), (3, 2)],
                         ids=["one-top2", "one-top3", "one-top1", "three-tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference_and_leaves_the_workspace_zeroed(triton_device: str, tokens: int, top_k: int,
                                                          dtype: torch.dtype) -> None:
    """Correct for any batch (three tokens: slots share experts); after every call the accumulator,
    the flags and the ticket are zero again, so the next call (or a graph replay) needs no clearing."""
    from engine.layers.moe.one_launch import OneLaunchWorkspace, fused_moe_one_launch

    workspace = OneLaunchWorkspace(3, H, triton_device)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for seed in (1, 2):  # the second call reuses the workspace the first left
        x, w13, w2, w, ids = _case(triton_device, tokens, top_k, dtype, seed=seed * 10 + tokens + top_k)
        ours = fused_moe_one_launch(x, w13, w2, w, ids, workspace=workspace, tiles=SMALL_TILES)
        ref = fused_moe_reference(x.float(), w13.float(), w2.float(), w, ids)
        assert ours.shape == (tokens, H) and ours.dtype == dtype
        torch.testing.assert_close(ours.float(), ref, atol=tol, rtol=tol)
        assert workspace.acc.abs().max().item() == 0 and workspace.flags.abs().max().item() == 0


@pytest.mark.parametrize("tiles", [SMALL_TILES, {"BLOCK_I": 8, "BLOCK_K": 16, "BLOCK_H": 16},
                                   {"BLOCK_I": 64, "BLOCK_K": 64, "BLOCK_H": 64}, None],
                         ids=["default-small", "many-programs", "one-tile", "picked"])
def test_tile_sizes_change_nothing_but_the_float32_order(triton_device: str, tiles: dict[str, int] | None) -> None:
    """Every tiling gives the reference's result; the fixed-point total is exact, so tilings differ only
    by the float32 sums inside each program."""
    from engine.layers.moe.one_launch import fused_moe_one_launch

    x, w13, w2, w, ids = _case(triton_device, 1, 3, torch.float32, seed=7)
    ref = fused_moe_reference(x, w13, w2, w, ids)
    torch.testing.assert_close(fused_moe_one_launch(x, w13, w2, w, ids, tiles=tiles), ref, atol=1e-5, rtol=1e-5)


def test_slots_held_elsewhere_add_nothing(triton_device: str) -> None:
    """Expert-parallel ids: -1 (another rank's expert) contributes zero but still takes its ticket, so
    the last program still writes the row."""
    from engine.layers.moe.one_launch import fused_moe_one_launch

    x, w13, w2, w, _ = _case(triton_device, 1, 3, torch.float32, seed=4)
    ids = torch.tensor([[2, -1, 5]], dtype=torch.int32, device=triton_device)
    ours = fused_moe_one_launch(x, w13, w2, w, ids, tiles=SMALL_TILES)
    ref = fused_moe_reference(x, w13, w2, w[:, [0, 2]], torch.tensor([[2, 5]], dtype=torch.int32, device=triton_device))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    all_elsewhere = torch.full((1, 3), -1, dtype=torch.int32, device=triton_device)
    assert fused_moe_one_launch(x, w13, w2, w, all_elsewhere, tiles=SMALL_TILES).abs().max().item() == 0.0


def test_per_channel_scales(triton_device: str) -> None:
    """The fp8 layout (one scale per expert and output channel; float32 codes here, since the
    interpreter holds no fp8): gate/up scales on the activations' inputs, down scales on each sum."""
    from engine.layers.moe.one_launch import fused_moe_one_launch

    x, w13, w2, w, ids = _case(triton_device, 1, 2, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    s13 = (torch.rand(E, 2 * INTER, generator=gen) + 0.5).to(triton_device)
    s2 = (torch.rand(E, H, generator=gen) + 0.5).to(triton_device)
    ours = fused_moe_one_launch(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, tiles=SMALL_TILES)
    ref = fused_moe_reference(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_sums_past_the_fixed_point_range_give_nan_not_a_clamped_value(triton_device: str) -> None:
    """A partial sum beyond ``FIXED_POINT_LIMIT`` (or NaN) cannot be added exactly in int64: that token's
    row is NaN (as float sums would overflow or propagate), the other token's row is unaffected, and
    the workspace is zeroed for the next call."""
    from engine.layers.moe.one_launch import FIXED_POINT_LIMIT, OneLaunchWorkspace, fused_moe_one_launch

    x, w13, w2, w, ids = _case(triton_device, 2, 2, torch.float32, seed=8)
    workspace = OneLaunchWorkspace(2, H, triton_device)
    x[1] *= FIXED_POINT_LIMIT**0.5  # gate * up scales with x squared: token 1's sums pass the limit
    out = fused_moe_one_launch(x, w13, w2, w, ids, workspace=workspace, tiles=SMALL_TILES)
    assert torch.isnan(out[1]).all()
    torch.testing.assert_close(out[0], fused_moe_reference(x[:1], w13, w2, w[:1], ids[:1])[0], atol=1e-4, rtol=1e-4)
    assert workspace.acc.abs().max().item() == 0 and workspace.flags.abs().max().item() == 0
    x[1] = float("nan")
    out = fused_moe_one_launch(x, w13, w2, w, ids, workspace=workspace, tiles=SMALL_TILES)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()


def test_bad_arguments_name_what_is_accepted() -> None:
    from engine.layers.moe.one_launch import OneLaunchWorkspace, fused_moe_one_launch

    x, w13, w2, w, ids = _case("cpu", 2, 2, torch.float32, seed=9)
    with pytest.raises(ValueError, match=r"fused_moe_one_launch: w13 .*w2 .*accepted"):
        fused_moe_one_launch(x, w13, w2[:, :, :-1], w, ids)
    with pytest.raises(ValueError, match="unit stride"):
        fused_moe_one_launch(x, w13, w2.transpose(1, 2).contiguous().transpose(1, 2), w, ids)
    with pytest.raises(ValueError, match=r"workspace for 1 tokens x 48 .* the call has 2 x 48"):
        fused_moe_one_launch(x, w13, w2, w, ids, workspace=OneLaunchWorkspace(1, H, "cpu"))


def test_fused_moe_takes_it_at_one_token_given_a_workspace(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused_moe(..., one_launch=workspace)``: one token takes the one-launch kernel; two tokens, or no
    workspace, the small-batch path as before."""
    import engine.layers.moe.fused_moe as fused_module
    from engine.layers.moe.one_launch import OneLaunchWorkspace

    taken: list[str] = []
    real_one, real_small = fused_module.fused_moe_one_launch, fused_module.fused_moe_small_batch
    monkeypatch.setattr(fused_module, "fused_moe_one_launch", lambda *a, **k: taken.append("one") or real_one(*a, **k))
    monkeypatch.setattr(fused_module, "fused_moe_small_batch",
                        lambda *a, **k: taken.append("small") or real_small(*a, **k))
    workspace = OneLaunchWorkspace(1, H, triton_device)
    for tokens, given in ((1, workspace), (1, None), (2, workspace)):
        x, w13, w2, w, ids = _case(triton_device, tokens, 8, torch.float32, seed=tokens, experts=128)
        out = fused_module.fused_moe(x, w13, w2, w, ids, one_launch=given)
        torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, w, ids), atol=1e-4, rtol=1e-4)
    assert taken == ["one", "small", "small"]


def test_the_layer_keeps_one_workspace_when_the_platform_offers_it(triton_path: list[tuple[str, object]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``FusedMoE`` with the ``moe_one_launch`` entry: one token's experts go through the one-launch kernel
    with the layer's workspace (made once, reused); without the entry, or at two tokens, no workspace."""
    import engine.layers.moe.fused_moe as fused_module
    import engine.layers.moe.layer as layer_module

    given: list[object] = []
    real = fused_module.fused_moe  # triton_path's recording wrapper
    monkeypatch.setattr(fused_module, "fused_moe", lambda *a, **k: given.append(k.get("one_launch")) or real(*a, **k))
    torch.manual_seed(0)
    moe = layer_module.FusedMoE(16, 2, H, INTER, renormalize=True)
    moe.w13_weight.data.normal_(std=H**-0.5)
    moe.w2_weight.data.normal_(std=INTER**-0.5)
    x, logits = torch.randn(2, H), torch.randn(2, 16)
    moe(x[:1], logits[:1])
    moe.use_kernels({"moe_one_launch": True})
    for _ in range(2):
        out = moe(x[:1], logits[:1])
    moe(x, logits)
    assert given[0] is None and given[1] is not None and given[2] is given[1] and given[3] is None
    assert moe.one_launch_workspace is None  # only set during forward
    w, ids = select_experts_reference(logits[:1], 2, True)
    torch.testing.assert_close(out, fused_moe_reference(x[:1], moe.w13_weight, moe.w2_weight, w, ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant", ["bf16", "fp8"])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_qwen3_moe_shape_against_two_launches_in_a_graph(quant: str, pdl: bool,
                                                         replays_like_eager: Callable[..., None]) -> None:
    """128 experts, top 8, hidden 2048, intermediate 768 (Qwen3-30B-A3B), bf16 or fp8 codes with
    per-channel scales: against the reference and the two-launch path; the same call twice is bit-equal
    (the fixed-point total does not depend on the programs' order); a CUDA graph of router + the launch
    replays bit-equal to eager calls on new inputs, with and without programmatic dependent launch."""
    from engine.layers.moe.fused_moe import fused_moe
    from engine.layers.moe.one_launch import OneLaunchWorkspace, fused_moe_one_launch
    from engine.layers.moe.router import select_experts
    from engine.layers.moe.small_batch import fused_moe_small_batch

    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    x, w13, w2, w, ids = _case("cuda", 1, 8, torch.bfloat16, seed=11, experts=128, hidden=2048, inter=768)
    scales: dict[str, torch.Tensor] = {}
    if quant == "fp8":
        def q(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            s = t.float().abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            return (t.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s
        w13, scales["w13_scale"] = q(w13)
        w2, scales["w2_scale"] = q(w2)
    workspace = OneLaunchWorkspace(1, 2048, "cuda")
    ours = fused_moe_one_launch(x, w13, w2, w, ids, workspace=workspace, **scales)
    ref = fused_moe_reference(x.float(), w13 if quant == "fp8" else w13.float(), w2 if quant == "fp8" else w2.float(),
                              w, ids, **scales)
    torch.testing.assert_close(ours.float(), ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ours, fused_moe_small_batch(x, w13, w2, w, ids, **scales), atol=2e-2, rtol=2e-2)
    for _ in range(3):
        torch.testing.assert_close(fused_moe_one_launch(x, w13, w2, w, ids, workspace=workspace, **scales), ours,
                                   atol=0, rtol=0)

    logits = torch.randn(1, 128, device="cuda")

    def step() -> torch.Tensor:
        wt, i = select_experts(logits, 8, True, pdl=pdl)
        return fused_moe(x, w13, w2, wt, i, pdl=pdl, one_launch=workspace, **scales)

    replays_like_eager(step, [x, logits], seeds=(12, 13))
    assert workspace.acc.abs().max().item() == 0 and workspace.flags.abs().max().item() == 0
