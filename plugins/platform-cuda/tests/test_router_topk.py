"""The MoE router's logits and its softmax top-k in one launch (``router_topk.norm_router_topk``)
against the two launches it replaces (``gemv.norm_skinny_linear``, then
``router_kernel.select_experts_triton`` on its logits): every output equal, not close.

Without a GPU the kernels run in Triton's interpreter on the CPU (the root conftest sets
``TRITON_INTERPRET=1``; float16 there, whose arithmetic the interpreter does faithfully); on a GPU
the same tests run compiled in bfloat16 (marked gpu), with the decode shapes, PDL and CUDA graph
replays added. The compiled code's reduction order is checked without a GPU by
test_router_topk_sm90_compile.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from engine_platform_cuda import router_topk
from engine_platform_cuda.gemv import GemvRule, norm_skinny_linear
from engine_platform_cuda.kernels import layer_kernels
from engine_platform_cuda.router_topk import RouterTopK, norm_router_topk, topk_tile_rows

from engine.layers.layernorm import PendingNorm
from engine.layers.moe.router import select_experts_reference
from engine.layers.moe.router_kernel import select_experts_triton

ON_GPU = torch.cuda.is_available() and torch.version.hip is None
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
pytestmark = pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU and Triton's interpreter is off (TRITON_INTERPRET=1 runs these on CPU)")
EPS = 1e-6


def _operands(experts: int, hidden: int, seed: int, residual: bool = True, bias: bool = False,
              scale: float = 1.0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {"x": draw(1, hidden).to(DEVICE, DTYPE), "residual": draw(1, hidden).to(DEVICE, DTYPE) if residual else None,
            "norm_weight": (1.0 + 0.2 * draw(hidden)).to(DEVICE, DTYPE),
            "weight": (draw(experts, hidden) * scale / hidden**0.5).to(DEVICE, DTYPE),
            "bias": draw(experts).to(DEVICE, DTYPE) if bias else None}


def _two_launches(ops: dict[str, Any], top_k: int, renormalize: bool, pdl: bool = False,
                  rule: GemvRule | None = None) -> tuple[torch.Tensor, ...]:
    """What the one launch replaces, as ``FusedMoE`` ran it: the router's norm-fused GEMM, then the top-k."""
    extra = {} if rule is None else {"rule": rule}
    logits, normed, res_sum = norm_skinny_linear(ops["x"], ops["residual"], ops["norm_weight"], EPS, ops["weight"],
                                                 ops["bias"], pdl=pdl, **extra)
    weights, ids = select_experts_triton(logits, top_k, renormalize, pdl=pdl)
    return logits, weights, ids, normed, res_sum


def _one_launch(ops: dict[str, Any], top_k: int, renormalize: bool, pdl: bool = False,
                rule: GemvRule | None = None) -> tuple[torch.Tensor, ...]:
    extra = {} if rule is None else {"rule": rule}
    return norm_router_topk(ops["x"], ops["residual"], ops["norm_weight"], EPS, ops["weight"], ops["bias"], top_k,
                            renormalize, pdl=pdl, **extra)


def _assert_equal(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    names = ("logits", "topk_weights", "topk_ids", "normed", "res_sum")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), (name, a, b)


# -- every device: the interpreter on the CPU, compiled on a GPU --------------------------------

@pytest.mark.parametrize("experts, top_k", [(8, 2), (8, 8), (16, 4), (64, 6), (128, 8), (128, 2), (256, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_equals_the_two_launches(experts: int, top_k: int, renormalize: bool) -> None:
    hidden = 2048 if ON_GPU else 192
    for seed, residual in ((experts * 10 + top_k, True), (experts * 10 + top_k + 1, False)):
        ops = _operands(experts, hidden, seed, residual=residual, scale=4.0)
        got = _one_launch(ops, top_k, renormalize)
        want = _two_launches(ops, top_k, renormalize)
        _assert_equal(got, want)
        # And the routing is torch's (the oracle of the top-k kernel).
        ref_w, ref_ids = select_experts_reference(want[0].float().cpu(), top_k, renormalize)
        assert torch.equal(got[2].cpu(), ref_ids)
        torch.testing.assert_close(got[1].cpu(), ref_w, atol=1e-6, rtol=1e-5)


def test_bias_and_norm_rows_summed_in_several_tiles() -> None:
    """A router bias, and a rule whose norm tile is shorter than the row (the sum of squares in
    tile-wide partial sums, as the skinny GEMM then sums it)."""
    rule = GemvRule(norm_row_tile=64)
    ops = _operands(128, 320, seed=5, bias=True)
    _assert_equal(_one_launch(ops, 8, True, rule=rule), _two_launches(ops, 8, True, rule=rule))


@pytest.mark.parametrize("experts, hidden, rule", [(128, 2048, None), (8, 4096, None), (256, 7168, None),
                                                  (128, 320, GemvRule(norm_row_tile=64)), (64, 96, None)])
@pytest.mark.parametrize("residual, bias", [(True, False), (False, True)])
def test_launches_the_skinny_gemm_as_norm_skinny_linear_does(experts: int, hidden: int, rule: GemvRule | None,
                                                             residual: bool, bias: bool) -> None:
    """Recorded, not run (decode shapes too): the fused launch hands the skinny GEMM's code the grid,
    tile constants, warps and arguments ``norm_skinny_linear`` launches it with (PDL on, as the engine
    launches both), and its top-k the logits' row stride ``select_experts_triton`` reads them with."""
    from engine_platform_cuda.gemv import _gemv_fma_kernel
    from engine_platform_cuda.router_topk import _norm_router_topk_kernel

    from engine.layers.moe.router_kernel import _softmax_topk_kernel
    from engine.testing.aot import captured_launches

    ops = _operands(experts, hidden, seed=1, residual=residual, bias=bias)
    with captured_launches(_gemv_fma_kernel, _softmax_topk_kernel, _norm_router_topk_kernel) as launches:
        _two_launches(ops, 8, True, pdl=True, rule=rule)
        _one_launch(ops, 8, True, pdl=True, rule=rule)
    gemv, topk, fused = launches
    assert fused.grid == gemv.grid
    assert gemv.kwargs["NORM"] and not gemv.kwargs["SPLIT"] and gemv.kwargs["PRE"] == 1
    shared = ("K", "K_SPLIT", "HAS_BIAS", "EVEN_K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "PDL", "HAS_RES", "ROW_BLOCK",
              "num_warps", "num_stages", "launch_pdl")
    assert {k: fused.kwargs[k] for k in shared} == {k: gemv.kwargs[k] for k in shared}
    # Arguments by position (the fused kernel has no split-K partials pointer).
    gemv_args = gemv.args[:4] + gemv.args[5:]
    for i, (ours, theirs) in enumerate(zip(fused.args[:len(gemv_args)], gemv_args, strict=True)):
        if isinstance(theirs, torch.Tensor):
            assert ours.shape == theirs.shape and ours.stride() == theirs.stride(), i
            if i not in (2, 3, 11, 12):  # bias placeholder, logits, normed, res_sum: new tensors
                assert ours.data_ptr() == theirs.data_ptr(), i
        else:
            assert ours == theirs, i
    assert fused.args[8] == topk.args[4]  # the logits' row stride, as the top-k kernel reads it


def test_ties_go_to_the_lower_expert() -> None:
    """Experts 2, 5 and 9 share a weight row and the others hold its negation: two groups of equal
    logits. Of equal probabilities the lower id comes first, as the top-k kernel orders them; all
    equal: ids 0, 1, ... with equal weights."""
    ops = _operands(16, 128, seed=7)
    row = ops["weight"][0].clone()
    ops["weight"].copy_(-row.expand(16, -1))
    ops["weight"][[2, 5, 9]] = row
    got = _one_launch(ops, 4, False)
    _assert_equal(got, _two_launches(ops, 4, False))
    tied_high = got[0][0, 2].item() > 0
    assert got[2].tolist() == [[2, 5, 9, 0] if tied_high else [0, 1, 3, 4]]
    flat = _operands(8, 128, seed=8)
    flat["weight"].zero_()
    got = _one_launch(flat, 8, True)
    assert got[2].tolist() == [list(range(8))]
    assert torch.equal(got[1], torch.full((1, 8), 0.125, device=DEVICE))
    _assert_equal(got, _two_launches(flat, 8, True))


def test_repeated_calls_find_the_ticket_back_at_zero() -> None:
    """Each launch's last program puts the counter back: the next launch, another shape included,
    routes again (without the reset no later program would draw the last ticket)."""
    for call, (experts, top_k) in enumerate([(128, 8), (128, 8), (8, 2), (64, 6), (128, 8)]):
        ops = _operands(experts, 128, seed=100 + call)
        _assert_equal(_one_launch(ops, top_k, True), _two_launches(ops, top_k, True))
        assert router_topk._TICKETS[ops["x"].device].item() == 0


def test_buffers_of_the_caller_are_filled() -> None:
    ops = _operands(32, 128, seed=9)
    normed = torch.empty(1, 128, dtype=DTYPE, device=DEVICE)
    res_sum = torch.empty(1, 128, dtype=DTYPE, device=DEVICE)
    got = norm_router_topk(ops["x"], ops["residual"], ops["norm_weight"], EPS, ops["weight"], None, 4, True,
                           normed=normed, res_sum=res_sum)
    assert got[3] is normed and got[4] is res_sum
    _assert_equal(got, _two_launches(ops, 4, True))


def test_bad_inputs_are_refused_by_name() -> None:
    ops = _operands(8, 64, seed=1)
    args = (ops["residual"], ops["norm_weight"], EPS, ops["weight"], None)
    with pytest.raises(ValueError, match=r"norm_router_topk: x shape \(2, 64\).*accepted: \[1, K\]"):
        norm_router_topk(ops["x"].repeat(2, 1), ops["residual"].repeat(2, 1), *args[1:], 2, True)
    with pytest.raises(ValueError, match="top_k 9 out of range for 8 experts; accepted: 1..8"):
        norm_router_topk(ops["x"], *args, 9, True)
    with pytest.raises(ValueError, match=r"weight shape \(8, 32\)"):
        norm_router_topk(ops["x"], *args[:3], ops["weight"][:, :32], None, 2, True)
    with pytest.raises(ValueError, match="residual shape"):
        norm_router_topk(ops["x"], ops["residual"].float(), *args[1:], 2, True)
    with pytest.raises(ValueError, match="no one-launch plan: 60 experts"):
        norm_router_topk(ops["x"], *args[:3], _operands(60, 64, seed=2)["weight"], None, 2, True)


# -- which expert counts get one launch -----------------------------------------------------------

def test_top_k_tile_rows() -> None:
    """One row a warp of the fused kernel where the top-k kernel runs on one warp and its row does not
    wrap around the warp's registers; the row itself where it runs on the kernel's 4 warps; none
    where it wraps (60 or 100 experts: no vector loads, so a thread holds values 32 apart) or needs
    8 warps (over 1024 experts)."""
    assert [topk_tile_rows(e, e, 4) for e in (4, 8, 16, 20, 32, 48, 64, 128)] == [4] * 8
    assert [topk_tile_rows(e, e, 4) for e in (60, 100, 127)] == [None] * 3
    assert [topk_tile_rows(e, e, 4) for e in (129, 160, 256, 1000, 1024)] == [1] * 5
    assert topk_tile_rows(2048, 2048, 4) is None and topk_tile_rows(128, 128, 2) == 2


# -- the layer kernel ---------------------------------------------------------------------------

def _norm_linear() -> Any:
    """The skinny GEMM with norm fusion, PDL off (``layer_kernels()['linear']``): the router's kernel."""
    return layer_kernels(norm_fusion=True)["linear"]


def _pending(ops: dict[str, Any]) -> PendingNorm:
    x = ops["x"]
    return PendingNorm(x, ops["residual"], ops["norm_weight"], EPS, torch.empty_like(x),
                       torch.empty_like(x) if ops["residual"] is not None else x)


def test_layer_kernel_takes_one_token_of_a_planned_router() -> None:
    kernel = RouterTopK(_norm_linear())
    ops = _operands(128, 128, seed=3)
    pending = _pending(ops)
    assert kernel.takes(pending, ops["weight"], None, 8)
    logits, weights, ids = kernel(pending, ops["weight"], None, 8, True)
    want = _two_launches(ops, 8, True)
    assert torch.equal(logits, want[0]) and torch.equal(weights, want[1]) and torch.equal(ids, want[2])
    assert torch.equal(pending.normed, want[3]) and torch.equal(pending.res_sum, want[4])
    two = _operands(128, 128, seed=4)
    two["x"], two["residual"] = two["x"].repeat(2, 1), two["residual"].repeat(2, 1)
    assert not kernel.takes(_pending(two), two["weight"], None, 8)  # two tokens
    assert not kernel.takes(pending, ops["weight"], None, 129)  # more than the experts
    assert not kernel.takes(pending, _operands(60, 128, seed=5)["weight"], None, 4)  # no plan
    assert not kernel.takes(pending, ops["weight"].float(), None, 8)  # not the skinny GEMM's dtypes


@pytest.mark.parametrize("experts, top_k, launched", [(128, 8, True), (8, 2, True), (60, 4, False)])
def test_fused_moe_layer_routes_with_the_kernel(experts: int, top_k: int, launched: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``FusedMoE.forward_with_router`` with the layer kernel: at one token the router's launch gives the
    routing, and the layer's output, norm output and residual sum equal the router's norm-fused GEMM
    then the top-k kernel (``select_experts`` on the CPU made to take the kernel too); 60 experts
    have no plan and keep the two launches."""
    import engine.layers.moe.layer as layer_module
    from engine.layers.linear import ReplicatedLinear
    from engine.layers.moe import FusedMoE

    monkeypatch.setattr(layer_module, "select_experts",
                        lambda logits, k, renorm, pdl=False: select_experts_triton(logits, k, renorm))
    launches = [0]
    real = router_topk.norm_router_topk

    def counting(*args: Any, **kwargs: Any) -> Any:
        launches[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(router_topk, "norm_router_topk", counting)
    linear = _norm_linear()
    hidden, inter = 128, 32
    gen = torch.Generator().manual_seed(experts)
    moe = FusedMoE(experts, top_k, hidden, inter, renormalize=True, params_dtype=DTYPE)
    moe.w13_weight.data.copy_(torch.randn(moe.w13_weight.shape, generator=gen) / hidden**0.5)
    moe.w2_weight.data.copy_(torch.randn(moe.w2_weight.shape, generator=gen) / inter**0.5)
    moe.to(DEVICE)
    router = ReplicatedLinear(hidden, experts, params_dtype=DTYPE).to(DEVICE)
    router.weight.data.copy_(_operands(experts, hidden, seed=experts, scale=4.0)["weight"])
    router.use_kernels({"linear": linear})
    ops = _operands(experts, hidden, seed=experts + 1)
    want_in = _pending(ops)
    want = moe.forward_with_router(want_in, router)  # no router_topk yet: the two launches
    moe.use_kernels({"router_topk": RouterTopK(linear)})
    got_in = _pending(ops)
    got = moe.forward_with_router(got_in, router)
    assert launches[0] == int(launched)
    assert torch.equal(got, want)
    assert torch.equal(got_in.normed, want_in.normed) and torch.equal(got_in.res_sum, want_in.res_sum)


def test_offered_with_pdl_and_norm_fusion_unless_turned_off() -> None:
    on = layer_kernels(pdl=True, norm_fusion=True)
    assert isinstance(on["router_topk"], RouterTopK) and on["router_topk"].linear is on["linear"]
    assert on["linear"].pdl is True
    assert "router_topk" not in layer_kernels(pdl=True, norm_fusion=True, router_topk=False)
    assert "router_topk" not in layer_kernels(pdl=False, norm_fusion=True)  # no PDL: the two launches
    assert "router_topk" not in layer_kernels(pdl=True, norm_fusion=False)  # no norm-fused router
    assert "router_topk" not in layer_kernels(gemv_max_rows=0, pdl=True, norm_fusion=True)


def test_option_is_on_by_default_and_checked() -> None:
    from engine_platform_cuda import DEFAULT_OPTIONS
    from engine_platform_cuda.platform import CudaPlatform

    from engine import plugins
    from engine.cli import build_server_args
    from engine.errors import ConfigError

    assert DEFAULT_OPTIONS["router_topk"] is True
    assert plugins.plugin_options()["cuda.router_topk"].default is True
    args = build_server_args({"plugin_option": ["cuda.router_topk=off"]})
    assert args.plugin_options == {"cuda": {"router_topk": False}}
    plugins.check_plugin_options(args.plugin_options)
    assert CudaPlatform({"router_topk": False}).options["router_topk"] is False
    with pytest.raises(ConfigError, match=r"cuda\.router_topk: invalid value 'maybe'; accepted: on/true or off/false"):
        CudaPlatform({"router_topk": "maybe"})
    expected = CudaPlatform().is_available() and CudaPlatform().layer_kernels()["linear"].pdl
    assert ("router_topk" in CudaPlatform().layer_kernels()) is bool(expected)
    assert "router_topk" not in CudaPlatform({"router_topk": False}).layer_kernels()


# -- the GPU: decode shapes, PDL, CUDA graphs -----------------------------------------------------

def _supports_pdl() -> bool:
    return ON_GPU and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize("experts, hidden, top_k", [(128, 2048, 8), (128, 4096, 8), (8, 4096, 2), (64, 2048, 6),
                                                    (256, 7168, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_decode_shapes_bit_equal_with_pdl_eager_and_in_a_graph(experts: int, hidden: int, top_k: int,
                                                               renormalize: bool) -> None:
    """The models' router shapes in bf16, many random draws: the one launch (with PDL where the GPU
    has it, as the engine launches it) equals the two launches bit for bit, eagerly and replayed in a
    CUDA graph on new inputs; the graph's ticket is back at 0 after every replay."""
    pdl = _supports_pdl()
    ops = _operands(experts, hidden, seed=experts + hidden, scale=4.0)
    for seed in range(20):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for t in (ops["x"], ops["residual"]):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen).to(t.dtype))
        _assert_equal(_one_launch(ops, top_k, renormalize, pdl), _two_launches(ops, top_k, renormalize, pdl))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _one_launch(ops, top_k, renormalize, pdl)
        _two_launches(ops, top_k, renormalize, pdl)
    torch.cuda.current_stream().wait_stream(side)
    one, two = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(one):
        got = _one_launch(ops, top_k, renormalize, pdl)
    with torch.cuda.graph(two):
        want = _two_launches(ops, top_k, renormalize, pdl)
    for seed in range(100, 110):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for t in (ops["x"], ops["residual"]):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen).to(t.dtype))
        one.replay()
        two.replay()
        _assert_equal(got, want)
        _assert_equal(got, _two_launches(ops, top_k, renormalize, pdl))
        assert router_topk._TICKETS[ops["x"].device].item() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_chain_of_layers_in_a_graph_with_the_experts() -> None:
    """48 routers each followed by the small-batch experts (gate/up waits for the one launch, down
    reads its routing before its own wait), captured in one graph with PDL: bit-equal to the same
    chain with the two routing launches, so one counter serves every layer of a step."""
    from engine.layers.moe.fused_moe import fused_moe

    pdl = _supports_pdl()
    # 48 routers; the experts' weights (1.2 GB a layer) are shared: the chain's order is what is tested.
    layers = [_operands(128, 2048, seed=1000 + i) for i in range(48)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(128, 2 * 768, 2048, device="cuda", generator=gen) / 2048**0.5).to(DTYPE)
    w2 = (torch.randn(128, 2048, 768, device="cuda", generator=gen) / 768**0.5).to(DTYPE)
    x0 = layers[0]["x"]

    def chain(fused: bool) -> torch.Tensor:
        hidden, residual = x0, layers[0]["residual"]
        for ops in layers:
            step = dict(ops, x=hidden, residual=residual)
            _, weights, ids, normed, res_sum = (_one_launch if fused else _two_launches)(step, 8, True, pdl)
            hidden, residual = fused_moe(normed, w13, w2, weights, ids, pdl=pdl), res_sum
        return hidden

    torch.testing.assert_close(chain(True), chain(False), atol=0, rtol=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for seed in (1, 2, 3):
        x0.copy_(torch.randn(x0.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
                 .to(x0.dtype))
        graph.replay()
        torch.testing.assert_close(out, chain(False), atol=0, rtol=0)
