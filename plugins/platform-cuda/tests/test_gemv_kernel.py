"""The skinny GEMM (``engine_platform_cuda.gemv``) against ``F.linear``.

On a GPU the kernel runs compiled, on the decode shapes it is made for (``SHAPES``). Without
one the root conftest sets ``TRITON_INTERPRET=1`` and the small-shape cases run in Triton's
interpreter on the CPU. Two limits of Triton 3.6's interpreter shape the CPU cases: it rounds
float32 -> bfloat16 by truncation (so bf16 outputs may be one unit in the last place below
``F.linear``'s round-to-nearest; the bf16 tolerance covers it), and its 16-bit ``tl.dot`` is
wrong (the kernel widens the dot's operands to float32 there).

Tolerance (``_assert_like_f_linear``): both sides accumulate in float32 and round once, in a
different order, so they may differ by one unit in the last place of the output dtype (bf16
2**-8 relative, fp16 2**-11) plus float32 reordering noise; against a float64 reference, the
kernel's relative L2 error must be within 1.25x of F.linear's own (or 1e-3 / 2e-4 bf16 / fp16;
2.5x for bf16 in the interpreter, which truncates).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_platform_cuda.gemv import (
    MAX_ROWS,
    GemvConfig,
    GemvRule,
    SkinnyLinear,
    choose_config,
    skinny_linear,
)

ON_GPU = torch.cuda.is_available() and torch.version.hip is None
DEVICE = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")

#: (N, K) of the decode GEMMs the kernel is for: Qwen3-30B-A3B qkv, o, router, LM head; Llama-3-8B
#: qkv, o, gate_up, down, LM head.
SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (6144, 4096), (4096, 4096),
          (28672, 4096), (4096, 14336), (128256, 4096)]
#: interpreter-sized shapes: N not a multiple of any block, K that no block_k divides (100, 200;
#: 48 for 32). Under the interpreter a case costs about its number of programs (N / block_n x
#: split-K); at 24 outputs a row and more, the interpreter's bf16 truncation error stays within
#: _assert_like_f_linear's 2.5x of F.linear's (fewer outputs make that ratio noisy).
SMALL = [(40, 64), (37, 200), (26, 48), (24, 100)]
TOL = {torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (2e-3, 2e-4)}


def _operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    # Drawn on the device: the largest weights (LM heads, 0.3-0.5 G values) are slow to draw on a CPU.
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEVICE)
    w = torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5  # outputs of unit scale
    b = torch.randn(n, generator=gen, device=DEVICE) if bias else None
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(x), cast(w), cast(b)


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def _assert_like_f_linear(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = F.linear(x, w, b)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    tol, floor = TOL[y.dtype]
    torch.testing.assert_close(y, ref, atol=tol, rtol=tol)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # The interpreter truncates to bf16: about twice round-to-nearest's error.
    factor = 2.5 if y.dtype == torch.bfloat16 and not ON_GPU else 1.25
    assert _rel_l2(y, exact) <= max(factor * _rel_l2(ref, exact), floor)


# -- every device: the interpreter on the CPU, compiled on a GPU --------------------------------

CONFIGS = [None, GemvConfig("fma", 8, 32), GemvConfig("fma", 1, 16, split_k=3), GemvConfig("dot", 16, 32),
           GemvConfig("dot", 32, 16, split_k=4, num_stages=2)]


#: Triton's interpreter runs a launch's programs one after another (a case of 390 programs took over
#: a minute): without a GPU, a config runs only the shapes it covers in at most this many programs,
#: and those over half of it in float16 only (bfloat16 meets that kernel on the other configs).
#: Every config still meets an N and a K that its blocks leave ragged; the full sweep runs on a GPU.
CPU_MAX_PROGRAMS = 75


def _small_cases() -> list[object]:
    cases = []
    for config in CONFIGS:
        name = "chosen" if config is None else f"{config.kind}-n{config.block_n}-k{config.block_k}-s{config.split_k}"
        for n, k in SMALL:
            programs = 0 if config is None else -(-n // config.block_n) * config.split_k
            for d, dtype in enumerate((torch.float16, torch.bfloat16)):
                on_cpu = programs <= (CPU_MAX_PROGRAMS if dtype == torch.float16 else CPU_MAX_PROGRAMS // 2)
                marks = [] if on_cpu else [gpu, needs_gpu]
                cases.append(pytest.param(dtype, config, n, k, id=f"{name}-{n}-{k}-dtype{d}", marks=marks))
    return cases


@pytest.mark.parametrize("dtype,config,n,k", _small_cases())
def test_small_shapes_every_config(dtype: torch.dtype, n: int, k: int, config: GemvConfig | None) -> None:
    for m in (1, 2, 3, 8):
        x, w, b = _operands(m, n, k, dtype, bias=m % 2 == 1, seed=m)
        _assert_like_f_linear(skinny_linear(x, w, b, config=config), x, w, b)


def test_split_k_partials_add_up_in_a_fixed_order() -> None:
    x, w, b = _operands(3, 40, 256, torch.float16, bias=True)
    split = GemvConfig("fma", 8, 16, split_k=8)
    first = skinny_linear(x, w, b, config=split)
    assert torch.equal(first, skinny_linear(x, w, b, config=split))  # deterministic
    _assert_like_f_linear(first, x, w, b)


def test_strided_rows_and_non_unit_k_stride() -> None:
    x, w, b = _operands(4, 40, 64, torch.float16, bias=True)
    wide = torch.zeros(4, 128, dtype=x.dtype, device=DEVICE)
    wide[:, 32:96] = x
    _assert_like_f_linear(skinny_linear(wide[:, 32:96], w, b), x, w, b)  # row stride 128
    xt = x.t().contiguous().t()  # same values, K stride 4: copied first
    _assert_like_f_linear(skinny_linear(xt, w, b), x, w, b)


def test_sixteen_rows_and_the_callable() -> None:
    x, w, b = _operands(MAX_ROWS, 37, 48, torch.float16, bias=True)
    _assert_like_f_linear(skinny_linear(x, w, b), x, w, b)
    kernel = SkinnyLinear(max_rows=4)
    assert kernel.max_rows == 4
    _assert_like_f_linear(kernel(x[:2], w), x[:2], w, None)


def test_bad_inputs_are_refused_by_name() -> None:
    x, w, b = _operands(2, 40, 64, torch.float16, bias=True)
    with pytest.raises(ValueError, match="at most 16"):
        skinny_linear(torch.zeros(17, 64, dtype=x.dtype, device=DEVICE), w)
    with pytest.raises(ValueError, match="dtypes"):
        skinny_linear(x.float(), w.float())
    with pytest.raises(ValueError, match="weight must be"):
        skinny_linear(x, w[:, :32])
    with pytest.raises(ValueError, match="unit stride along K"):
        skinny_linear(x, w.t().contiguous().t())  # [N, K] values, K stride N
    with pytest.raises(ValueError, match="bias shape"):
        skinny_linear(x, w, b[:10])
    with pytest.raises(ValueError, match="GemvConfig.block_n"):
        skinny_linear(x, w, config=GemvConfig("dot", 8, 32))
    with pytest.raises(ValueError, match="GemvConfig.kind"):
        skinny_linear(x, w, config=GemvConfig("wmma", 8, 32))


# -- the rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_chosen_configs_are_valid_and_fill_the_gpu(m: int, n: int, k: int) -> None:
    rule, sms = GemvRule(), 132
    cfg = choose_config(m, n, k, sm_count=sms)
    cfg.validate()
    assert cfg.kind == ("fma" if m <= rule.fma_max_rows else "dot")
    assert (-(-k // cfg.block_k)) % cfg.split_k == 0  # equal slices: no K masks
    n_blocks = -(-n // cfg.block_n)
    smallest = 1 if cfg.kind == "fma" else rule.dot_block_n[-1]
    assert n_blocks >= rule.ctas_per_sm * sms or cfg.block_n == smallest  # blocks shrink to fill the SMs
    if n_blocks >= sms:
        assert cfg.split_k == 1  # enough programs: no second launch
    elif cfg.block_n * k * 2 > rule.split_min_bytes:
        assert cfg.split_k > 1
        assert cfg.block_n * k * 2 // cfg.split_k >= rule.slice_min_bytes


def test_rule_is_tunable() -> None:
    rule = GemvRule(fma_max_rows=8)
    assert choose_config(8, 4096, 4096, 132, rule=rule).kind == "fma"
    assert choose_config(8, 4096, 4096, 132).kind == "dot"
    assert choose_config(1, 128, 2048, 132).split_k == 1  # 4 KB per program: no second launch


# -- GPU only: the decode shapes, graphs, the layer ----------------------------------------------

@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_decode_shapes_match_f_linear(dtype: torch.dtype, n: int, k: int) -> None:
    x8, w, bias = _operands(8, n, k, dtype, bias=True)
    for m in range(1, 9):
        x, b = x8[:m], bias if m in (1, 4, 7) else None
        _assert_like_f_linear(skinny_linear(x, w, b), x, w, b)


@gpu
@needs_gpu
@pytest.mark.parametrize("config", [None, GemvConfig("fma", 4, 512, split_k=4), GemvConfig("dot", 64, 128, split_k=8)],
                         ids=["chosen", "fma-split", "dot-split"])
def test_captured_in_a_cuda_graph(config: GemvConfig | None) -> None:
    x, w, b = _operands(4, 2048, 4096, torch.bfloat16, bias=True)
    static_x = x.clone()
    skinny_linear(static_x, w, b, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = skinny_linear(static_x, w, b, config=config)
    for seed in (1, 2):
        fresh, _, _ = _operands(4, 2048, 4096, torch.bfloat16, bias=False, seed=seed)
        static_x.copy_(fresh)
        graph.replay()
        _assert_like_f_linear(static_y, fresh, w, b)
        assert torch.equal(static_y, skinny_linear(fresh, w, b, config=config))


@gpu
@needs_gpu
@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs sm_90+")
@pytest.mark.parametrize("config", [None, GemvConfig("fma", 4, 512, split_k=4),
                                    GemvConfig("fma", 4, 512, pdl_steps=4), GemvConfig("fma", 8, 256, pdl_steps=2)],
                         ids=["chosen", "fma-split", "pre4-of-4", "pre2-of-8"])
def test_pdl_launch_is_bit_equal_in_a_graph_chain(config: GemvConfig | None) -> None:
    """With programmatic dependent launch each kernel reads the previous one's output only after
    griddepcontrol.wait: a captured chain of dependent calls gives the same bits as without, however
    many weight steps (``pdl_steps``) a program requests before that wait."""
    ws = [_operands(1, 2048, 2048, torch.bfloat16, bias=True, seed=s) for s in range(6)]
    static_x = ws[0][0].clone()

    def chain(pdl: bool) -> torch.Tensor:
        h = static_x
        for m in (1, 2):
            for _, w, b in ws:
                h = skinny_linear(h[:1].expand(m, -1).contiguous() if m == 2 else h[:1], w, b, config=config, pdl=pdl)
        return h

    expected = chain(False)
    chain(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@gpu
@needs_gpu
def test_model_layers_take_the_platform_kernel() -> None:
    from engine_platform_cuda.platform import CudaPlatform

    from engine.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(2048, 5120, bias=True, params_dtype=torch.bfloat16).cuda()
    layer.weight.data.normal_(std=2048**-0.5)
    layer.bias.data.normal_()
    kernels = CudaPlatform().layer_kernels()
    calls = []

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernels["linear"](x, weight, bias)

    spy.max_rows = kernels["linear"].max_rows  # type: ignore[attr-defined]
    layer.use_kernels({"linear": spy})
    for rows in (1, 8, 9, 64):
        x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
        _assert_like_f_linear(layer(x), x, layer.weight, layer.bias)
    assert calls == [1, 8]
    off = CudaPlatform(options={"gemv": False}).layer_kernels()
    assert "linear" not in off
