"""The small-batch expert launches that route for themselves (``fused_moe_small_batch_routed``)
against ``select_experts`` followed by the two-launch entry (bit for bit: the same routing math)
and against the torch reference.

On a CPU-only machine the kernels run in Triton's interpreter (the ``cpu`` case of
``triton_device``), on a GPU compiled (the ``cuda`` case, marked gpu, plus a bf16 / fp8
Qwen3-30B-A3B-like shape, programmatic dependent launch and a CUDA graph replay). Most cases use one
tile per program to keep the interpreter quick; one runs the default tiles.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.layers.moe.reference import fused_moe_reference
from engine.layers.moe.route_align import to_local_expert_ids
from engine.layers.moe.router import select_experts_reference

H, INTER = 48, 40
ONE_TILE = {"UP_BLOCK_N": 64, "UP_BLOCK_K": 64, "DOWN_BLOCK_N": 64, "DOWN_BLOCK_K": 64}


def _experts(device: str, experts: int, dtype: torch.dtype, seed: int, hidden: int = H,
             inter: int = INTER) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def _inputs(device: str, tokens: int, experts: int, seed: int, hidden: int = H) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen) * 3
    return x.to(device), logits.to(device)


def _two_launches(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, top_k: int,
                  renormalize: bool, expert_start: int = 0, num_local: int | None = None,
                  **kwargs: object) -> torch.Tensor:
    """What the routed entry replaces: the router's top-k launch (``select_experts`` on CUDA), the
    local ids, then the two expert launches."""
    from engine.layers.moe.router_kernel import select_experts_triton
    from engine.layers.moe.small_batch import fused_moe_small_batch

    w, ids = select_experts_triton(logits, top_k, renormalize)
    ids = to_local_expert_ids(ids, expert_start, logits.shape[1] - expert_start if num_local is None else num_local)
    return fused_moe_small_batch(x, w13, w2, w, ids, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("experts, top_k", [(6, 1), (6, 2), (6, 3), (40, 3), (40, 8), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "no-renorm"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_equals_top_k_launch_then_experts(triton_device: str, experts: int, top_k: int, renormalize: bool,
                                          tokens: int) -> None:
    """Bit-equal to the router's top-k launch followed by the two-launch experts (ids and weights
    are the same bits), and within float32 rounding of the torch routing and reference."""
    from engine.layers.moe.small_batch import fused_moe_small_batch_routed

    w13, w2 = _experts(triton_device, experts, torch.float32, seed=experts + top_k)
    x, logits = _inputs(triton_device, tokens, experts, seed=tokens * 100 + experts * 10 + top_k)
    ours = fused_moe_small_batch_routed(x, w13, w2, logits, top_k, renormalize, tiles=ONE_TILE)
    assert ours.shape == (tokens, H) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, _two_launches(x, w13, w2, logits, top_k, renormalize, tiles=ONE_TILE),
                               atol=0, rtol=0)
    w, ids = select_experts_reference(logits, top_k, renormalize)
    torch.testing.assert_close(ours, fused_moe_reference(x, w13, w2, w, ids), atol=1e-4, rtol=1e-4)


def test_default_tiles_and_16_bit_strided_logits(triton_device: str) -> None:
    """The tiles ``small_batch_tiles`` picks (128 experts, top 8), 16-bit weights and logits that are
    a column slice of a wider tensor (row stride != E)."""
    from engine.layers.moe.small_batch import fused_moe_small_batch_routed

    dtype = torch.bfloat16 if triton_device == "cuda" else torch.float16  # the interpreter's bf16 is not faithful
    w13, w2 = _experts(triton_device, 128, dtype, seed=1)
    x, wide = _inputs(triton_device, 1, 131, seed=2)
    x, logits = x.to(dtype), wide.to(dtype)[:, 2:130]
    ours = fused_moe_small_batch_routed(x, w13, w2, logits, 8, True)
    torch.testing.assert_close(ours, _two_launches(x, w13, w2, logits, 8, True), atol=0, rtol=0)
    w, ids = select_experts_reference(logits, 8, True)
    ref = fused_moe_reference(x.float(), w13.float(), w2.float(), w, ids)
    torch.testing.assert_close(ours.float(), ref, atol=2e-2, rtol=2e-2)


def test_ties_go_to_the_lower_expert(triton_device: str) -> None:
    """Equal logits (so equal probabilities) at the top-k boundary: the lower expert id is taken,
    as the router kernel takes it (token 0: experts 6 and 7 tie for the 4th slot; token 1: all tie)."""
    from engine.layers.moe.router_kernel import select_experts_triton
    from engine.layers.moe.small_batch import fused_moe_small_batch_routed

    w13, w2 = _experts(triton_device, 8, torch.float32, seed=3)
    x, _ = _inputs(triton_device, 2, 8, seed=4)
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -2.0, 2.0, 2.0], [0.5] * 8], device=triton_device)
    w, ids = select_experts_triton(logits, 4, renormalize=False)
    assert ids.tolist() == [[1, 2, 4, 6], [0, 1, 2, 3]]
    ours = fused_moe_small_batch_routed(x, w13, w2, logits, 4, False, tiles=ONE_TILE)
    torch.testing.assert_close(ours, fused_moe_reference(x, w13, w2, w, ids), atol=1e-4, rtol=1e-4)
    # Any other pick among the tied experts gives another result (the experts' weights differ).
    other = torch.tensor([[1, 2, 4, 7], [4, 5, 6, 7]], dtype=torch.int32, device=triton_device)
    for t in range(2):
        wrong = fused_moe_reference(x[t:t + 1], w13, w2, w[t:t + 1], other[t:t + 1])
        assert not torch.allclose(ours[t:t + 1], wrong, atol=1e-3, rtol=1e-3)


def _nan_fenced(w: torch.Tensor) -> torch.Tensor:
    """``w`` as a view into storage whose expert slabs just before and after it hold NaN: a read of
    any expert outside ``w`` poisons the result."""
    fenced = torch.full((w.shape[0] + 2, *w.shape[1:]), float("nan"), dtype=w.dtype, device=w.device)
    fenced[1:-1] = w
    return fenced[1:-1]


@pytest.mark.parametrize("tokens", [1, 2])
def test_expert_parallel_ranges(triton_device: str, tokens: int) -> None:
    """Each rank's kernels map ids to its range in-kernel: experts outside ``[start, start + n)``
    read nothing (their neighbours' NaN never shows) and add zero; the ranks of a split sum to the
    whole, and each equals the reference with ``to_local_expert_ids``."""
    from engine.layers.moe.small_batch import fused_moe_small_batch_routed

    experts, top_k = 40, 8
    w13, w2 = _experts(triton_device, experts, torch.float32, seed=5)
    x, logits = _inputs(triton_device, tokens, experts, seed=6 + tokens)
    w, ids = select_experts_reference(logits, top_k, True)
    whole = fused_moe_small_batch_routed(x, w13, w2, logits, top_k, True, tiles=ONE_TILE)
    for split in ([(0, 20), (20, 20)], [(0, 13), (13, 9), (22, 18)]):
        parts = []
        for start, n in split:
            local13, local2 = _nan_fenced(w13[start:start + n]), _nan_fenced(w2[start:start + n])
            part = fused_moe_small_batch_routed(x, local13, local2, logits, top_k, True, start, n, tiles=ONE_TILE)
            assert not part.isnan().any()
            ref = fused_moe_reference(x, w13[start:start + n], w2[start:start + n], w,
                                      to_local_expert_ids(ids, start, n))
            torch.testing.assert_close(part, ref, atol=1e-4, rtol=1e-4)
            parts.append(part)
        torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)


def test_a_range_holding_none_of_the_experts_adds_exact_zeros(triton_device: str) -> None:
    from engine.layers.moe.router_kernel import select_experts_triton
    from engine.layers.moe.small_batch import fused_moe_small_batch_routed

    w13, w2 = _experts(triton_device, 40, torch.float32, seed=7)
    x, logits = _inputs(triton_device, 1, 40, seed=8)
    _, ids = select_experts_triton(logits, 3, True)
    free = next(s for s in range(0, 40, 4) if not ((ids >= s) & (ids < s + 4)).any())
    out = fused_moe_small_batch_routed(x, _nan_fenced(w13[free:free + 4]), _nan_fenced(w2[free:free + 4]), logits, 3,
                                       True, free, 4, tiles=ONE_TILE)
    assert out.abs().max().item() == 0.0


def test_per_channel_scales(triton_device: str) -> None:
    """The fp8 layout (float32 codes here: the interpreter holds no fp8): the same bits as the
    two-launch entry with the same scales."""
    from engine.layers.moe.small_batch import fused_moe_small_batch_routed

    w13, w2 = _experts(triton_device, 6, torch.float32, seed=9)
    x, logits = _inputs(triton_device, 1, 6, seed=10)
    gen = torch.Generator().manual_seed(11)
    scales = {"w13_scale": (torch.rand(6, 2 * INTER, generator=gen) + 0.5).to(triton_device),
              "w2_scale": (torch.rand(6, H, generator=gen) + 0.5).to(triton_device)}
    ours = fused_moe_small_batch_routed(x, w13, w2, logits, 2, True, tiles=ONE_TILE, **scales)
    torch.testing.assert_close(ours, _two_launches(x, w13, w2, logits, 2, True, tiles=ONE_TILE, **scales),
                               atol=0, rtol=0)
    w, ids = select_experts_reference(logits, 2, True)
    torch.testing.assert_close(ours, fused_moe_reference(x, w13, w2, w, ids, **scales), atol=1e-4, rtol=1e-4)


def test_bad_arguments_name_the_field() -> None:
    from engine.layers.moe.small_batch import fused_moe_small_batch_routed

    w13, w2 = _experts("cpu", 6, torch.float32, seed=12)
    x, logits = _inputs("cpu", 1, 6, seed=13)
    with pytest.raises(ValueError, match=r"top_k 7 out of range for 6 experts; accepted: 1..6"):
        fused_moe_small_batch_routed(x, w13, w2, logits, 7, True)
    with pytest.raises(ValueError, match=r"top_k 0 out of range"):
        fused_moe_small_batch_routed(x, w13, w2, logits, 0, True)
    with pytest.raises(ValueError, match=r"router_logits \(2, 6\) for x \(1, 48\); accepted: \[1, num_experts\]"):
        fused_moe_small_batch_routed(x, w13, w2, torch.zeros(2, 6), 2, True)
    with pytest.raises(ValueError, match=r"local experts \[4, 8\) out of range for 6 experts"):
        fused_moe_small_batch_routed(x, w13[:4], w2[:4], logits, 2, True, 4, 4)
    with pytest.raises(ValueError, match=r"w13 holds 6 experts, the local range \[0, 3\) 3"):
        fused_moe_small_batch_routed(x, w13, w2, logits, 2, True, 0, 3)
    with pytest.raises(ValueError, match=r"fused_moe_small_batch_routed: w13 .*w2 .*accepted"):
        fused_moe_small_batch_routed(x, w13, w2[:, :, :-1], logits, 2, True)


def test_fused_moe_takes_the_routed_entry_with_a_pending_routing(triton_device: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused_moe(routing=...)``: the routed launches where the small-batch path applies; past it
    (three tokens), or with tiles given, the routing is resolved first and the grouped kernels run."""
    import engine.layers.moe.fused_moe as fused_module
    from engine.layers.moe.layer import PendingRouting

    taken: list[int] = []
    real = fused_module.fused_moe_small_batch_routed
    monkeypatch.setattr(fused_module, "fused_moe_small_batch_routed",
                        lambda x, *a, **k: taken.append(x.shape[0]) or real(x, *a, **k))
    w13, w2 = _experts(triton_device, 6, torch.float32, seed=14)
    grouped = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 1}
    for tokens, config in ((1, None), (3, None), (1, grouped)):
        x, logits = _inputs(triton_device, tokens, 6, seed=15 + tokens)
        routing = PendingRouting(logits, 2, True, 0, 6)
        out = fused_module.fused_moe(x, w13, w2, None, None, config=config, routing=routing)
        w, ids = select_experts_reference(logits, 2, True)
        torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, w, ids), atol=1e-4, rtol=1e-4)
    assert taken == [1]
    with pytest.raises(ValueError, match="topk_weights and topk_ids are None without a routing"):
        fused_module.fused_moe(x, w13, w2, None, None)


def _fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = t.float().abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (t.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant", ["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_qwen3_moe_shape_bit_equal_to_the_top_k_launch(quant: str, tokens: int) -> None:
    """128 experts, top 8, hidden 2048, intermediate 768 (Qwen3-30B-A3B), default tiles, bf16 or fp8
    codes: the routed launches give the bits of ``select_experts`` + ``fused_moe_small_batch``,
    with and without renormalisation, and with an expert-parallel half."""
    from engine.layers.moe.router import select_experts
    from engine.layers.moe.small_batch import fused_moe_small_batch, fused_moe_small_batch_routed

    w13, w2 = _experts("cuda", 128, torch.bfloat16, seed=30, hidden=2048, inter=768)
    x, logits = _inputs("cuda", tokens, 128, seed=31 + tokens, hidden=2048)
    x, logits = x.to(torch.bfloat16), logits.to(torch.bfloat16)
    scales: dict[str, torch.Tensor] = {}
    if quant == "fp8":
        w13, scales["w13_scale"] = _fp8(w13)
        w2, scales["w2_scale"] = _fp8(w2)
    for renormalize in (True, False):
        w, ids = select_experts(logits, 8, renormalize)
        ours = fused_moe_small_batch_routed(x, w13, w2, logits, 8, renormalize, **scales)
        torch.testing.assert_close(ours, fused_moe_small_batch(x, w13, w2, w, ids, **scales), atol=0, rtol=0)
    half = {k: v[64:] for k, v in scales.items()}
    ours = fused_moe_small_batch_routed(x, w13[64:], w2[64:], logits, 8, True, 64, 64,
                                        w13_scale=half.get("w13_scale"), w2_scale=half.get("w2_scale"))
    w, ids = select_experts(logits, 8, True)
    two = fused_moe_small_batch(x, w13[64:], w2[64:], w, to_local_expert_ids(ids, 64, 64),
                                w13_scale=half.get("w13_scale"), w2_scale=half.get("w2_scale"))
    torch.testing.assert_close(ours, two, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU with programmatic dependent launch (sm_90+)")
@pytest.mark.parametrize("tokens", [1, 2])
def test_pdl_routed_launches_equal_plain_ones_in_a_graph(tokens: int, replays_like_eager: Callable[..., None]) -> None:
    """With ``pdl`` gate/up waits for the logits' writer and then triggers; down routes and
    requests its first weight tile before it waits. After a GEMM that writes the logits (as the
    router's does), the graph of the three replays bit-equal to eager calls, and equals the launches
    without PDL and the two-launch path after the top-k launch (Qwen3-30B-A3B shape, bf16)."""
    from engine.layers.moe.router import select_experts
    from engine.layers.moe.small_batch import fused_moe_small_batch, fused_moe_small_batch_routed

    w13, w2 = _experts("cuda", 128, torch.bfloat16, seed=40, hidden=2048, inter=768)
    x, _ = _inputs("cuda", tokens, 128, seed=41, hidden=2048)
    x = x.to(torch.bfloat16)
    gate = (torch.randn(128, 2048, device="cuda") / 2048**0.5).to(torch.bfloat16)

    def step(pdl: bool = True) -> torch.Tensor:
        logits = x @ gate.t()
        return fused_moe_small_batch_routed(x, w13, w2, logits, 8, True, pdl=pdl)

    def two_launches() -> torch.Tensor:
        w, ids = select_experts(x @ gate.t(), 8, True)
        return fused_moe_small_batch(x, w13, w2, w, ids)

    torch.testing.assert_close(step(True), step(False), atol=0, rtol=0)
    torch.testing.assert_close(step(True), two_launches(), atol=0, rtol=0)
    replays_like_eager(step, [x], seeds=(42, 43))
    torch.testing.assert_close(step(True), two_launches(), atol=0, rtol=0)
