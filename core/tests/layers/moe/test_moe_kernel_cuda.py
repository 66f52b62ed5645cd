"""The fused MoE kernel compiled on a GPU against the torch reference (marked gpu).

Random routings at the sizes the tile heuristic switches on (decode: 1 and 7 tokens; prefills of
300 and 1,200: 37 and 150 slots an expert, the 64- and 128-row tiles), Qwen3-30B-A3B-like expert counts (64 experts, top 8; most get no token at batch 1),
bfloat16, expert-parallel ids (-1), and fp8 codes with per-channel scales; a decode step (router
and alignment, one launch or two, both GEMMs, the top-k sum) captured in a CUDA graph and
replayed on new inputs; the SiLU-and-mul epilogue against the separate activation; and
``FusedMoE`` itself on CUDA, sharded tp/ep as in test_moe_layer.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.layers.moe.reference import fused_moe_reference
from engine.layers.moe.router import select_experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, H, INTER, TOP_K = 64, 512, 256, 8


def _case(tokens: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=gen) / INTER**0.5).to(dtype)
    x = torch.randn(tokens, H, device="cuda", generator=gen).to(dtype)
    w, ids = select_experts(torch.randn(tokens, E, device="cuda", generator=gen), TOP_K, renormalize=True)
    return x, w13, w2, w, ids


@pytest.mark.parametrize("tokens", [1, 7, 300, 1200])
def test_bf16_random_routing(tokens: int) -> None:
    from engine.layers.moe.fused_moe import fused_moe

    x, w13, w2, w, ids = _case(tokens, tokens)
    ours = fused_moe(x, w13, w2, w, ids)
    ref = fused_moe_reference(x.float(), w13.float(), w2.float(), w, ids)
    torch.testing.assert_close(ours.float(), ref, atol=3e-2, rtol=3e-2)


def test_expert_parallel_halves_sum_to_whole() -> None:
    from engine.layers.moe.fused_moe import fused_moe

    x, w13, w2, w, ids = _case(33, 5)
    whole = fused_moe(x, w13, w2, w, ids).float()
    half = E // 2
    lo = torch.where(ids < half, ids, torch.full_like(ids, -1))
    hi = torch.where(ids >= half, ids - half, torch.full_like(ids, -1))
    parts = fused_moe(x, w13[:half], w2[:half], w, lo).float() + fused_moe(x, w13[half:], w2[half:], w, hi).float()
    torch.testing.assert_close(parts, whole, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens", [1, 64, 1200])
def test_fp8_codes(tokens: int) -> None:
    from engine.layers.moe.fused_moe import fused_moe

    x, w13, w2, w, ids = _case(tokens, 11)
    def quant(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = t.float().abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        return (t.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale
    q13, s13 = quant(w13)
    q2, s2 = quant(w2)
    ours = fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    ref = fused_moe_reference(x.float(), q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(ours.float(), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("routing", ["router-then-align", "route-and-align"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_decode_step_replays_in_a_cuda_graph(tokens: int, routing: str, replays_like_eager: Callable[..., None]) -> None:
    """Routing, alignment (one launch each, or both in one: ``route_and_align``), the GEMMs and the
    top-k sum have fixed shapes and no host syncs: captured once, the graph gives what eager calls
    give on fresh inputs."""
    from engine.layers.moe.fused_moe import fused_moe, pick_blocks
    from engine.layers.moe.route_align import route_and_align

    x, w13, w2, _, _ = _case(tokens, 21)
    logits = torch.randn(tokens, E, device="cuda")

    def step() -> torch.Tensor:
        if routing == "route-and-align":
            block_m = pick_blocks(tokens * TOP_K, E)["BLOCK_M"]
            w, ids, blocks = route_and_align(logits, TOP_K, True, block_m)
            return fused_moe(x, w13, w2, w, ids, blocks=blocks)
        w, ids = select_experts(logits, TOP_K, renormalize=True)
        return fused_moe(x, w13, w2, w, ids)

    replays_like_eager(step, [x, logits], seeds=(22, 23))


@pytest.mark.parametrize("tokens", [1, 64])
def test_silu_mul_epilogue_matches_the_separate_activation(tokens: int) -> None:
    """bf16: the gate/up epilogue against the gate/up launch writing both halves and
    ``F.silu(g) * u`` after it (the rounding of the platform's silu_and_mul)."""
    from engine.layers.moe.fused_moe import fused_moe

    x, w13, w2, w, ids = _case(tokens, 31)

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]

    torch.testing.assert_close(fused_moe(x, w13, w2, w, ids).float(), fused_moe(x, w13, w2, w, ids, act_fn=act).float(),
                               atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("tokens", [1, 37])
def test_sum_top_k_bf16(tokens: int) -> None:
    from engine.layers.moe.fused_moe import sum_top_k

    y = torch.randn(tokens * TOP_K, 2048, device="cuda").to(torch.bfloat16)
    torch.testing.assert_close(sum_top_k(y, tokens, TOP_K), y.view(tokens, TOP_K, -1).sum(1), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2), (4, 2)], ids=["one-rank", "tp2-ep2", "tp4-ep2"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 100])  # 100: routing and alignment as separate launches
def test_layer_shards_on_cuda(tokens: int, tp: int, ep: int) -> None:
    """``FusedMoE`` on CUDA (route_and_align with this rank's experts at decode sizes, the fused
    kernel, bf16): the shards of each layout sum to the reference of the whole layer."""
    from engine.distributed import set_expert_parallel, set_tensor_model_parallel
    from engine.layers.moe import FusedMoE

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=gen) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=gen) / INTER**0.5).to(torch.bfloat16)
    x = torch.randn(tokens, H, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, E, device="cuda", generator=gen)
    w, ids = select_experts(logits, TOP_K, renormalize=True)
    ref = fused_moe_reference(x.float(), w13.float(), w2.float(), w, ids)
    out = torch.zeros(tokens, H, device="cuda")
    try:
        for rank in range(tp):
            set_tensor_model_parallel(rank, tp)
            set_expert_parallel(ep)
            layer = FusedMoE(E, TOP_K, H, INTER, renormalize=True, params_dtype=torch.bfloat16, reduce_results=False)
            for e in range(E):
                layer.weight_loader(layer.w13_weight, w13[e, :INTER].cpu(), e, "w1")
                layer.weight_loader(layer.w13_weight, w13[e, INTER:].cpu(), e, "w3")
                layer.weight_loader(layer.w2_weight, w2[e].cpu(), e, "w2")
            out += layer.cuda()(x, logits).float()
    finally:
        set_tensor_model_parallel(0, 1)
        set_expert_parallel(1)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
