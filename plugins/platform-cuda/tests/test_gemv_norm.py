"""The skinny GEMM with the RMSNorm before it folded in (``gemv.norm_skinny_linear``) against the
two kernels it replaces (``kernels.rms_norm`` then ``gemv.skinny_linear``) and a float32 reference.

Without a GPU the root conftest sets ``TRITON_INTERPRET=1`` and all three kernels run in Triton's
interpreter on the CPU, where every output is bit-equal to the separate kernels': each row is
summed in one tile as ``rms_norm`` sums it and the GEMM then multiplies the same values in the
same order. Compiled on a GPU the sum of squares is reduced in another register layout than
``rms_norm``'s (float32 reordering), so a norm output may differ in the last place there (rarely).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_platform_cuda.gemv import (
    GemvConfig,
    GemvRule,
    SkinnyLinear,
    norm_skinny_linear,
    skinny_linear,
)
from engine_platform_cuda.kernels import rms_norm

from engine.layers.layernorm import PendingNorm

ON_GPU = torch.cuda.is_available() and torch.version.hip is None
DEVICE = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
EPS = 1e-6
#: interpreter-sized (N, K): K that no block_k divides (200, 100) and one that the chosen does; N
#: a whole tile of every block_n (8), more than one tile with a partial last one (9: N masking),
#: and less than one tile of 8 (4). Under the interpreter a case costs about its number of programs
#: (N / block_n x split-K), so N stays as small as these cases allow.
SMALL = [(8, 64), (9, 200), (4, 100)]
CONFIGS = [None, GemvConfig("fma", 8, 32), GemvConfig("fma", 1, 16, split_k=3), GemvConfig("fma", 4, 16, split_k=2)]
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
#: The fma kind (the only one with the norm) at 2 rows too: the default rule takes it at 1 row only
#: (2 rows run faster on the dot kind), but a tuned rule may take more.
RULE2 = GemvRule(fma_max_rows=2)


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=gen, device=DEVICE)  # noqa: E731
    x, r = draw(m, k).to(dtype), draw(m, k).to(dtype)
    norm_w = (1.0 + 0.2 * draw(k)).to(dtype)
    w = (draw(n, k) / k**0.5).to(dtype)
    b = draw(n).to(dtype)
    return x, r, norm_w, w, b


def _separate(x, r, norm_w, w, b, config=None, rule=RULE2):  # type: ignore[no-untyped-def]
    """What the fused kernel replaces: the norm kernel, then the skinny GEMM (with the same rule)."""
    out = rms_norm(x, norm_w, EPS, r)
    normed, res_sum = (out, x) if r is None else out
    return skinny_linear(normed, w, b, config=config, rule=rule), normed, res_sum


def _float32_reference(x, r, norm_w, w, b):  # type: ignore[no-untyped-def]
    h = x.float() if r is None else x.float() + r.float()
    normed = norm_w.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return F.linear(normed.double(), w.double(), None if b is None else b.double())


def _assert_norm_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    if not ON_GPU:
        assert torch.equal(got, want)
        return
    # Compiled: 1/rms may differ in float32's last place, which moves a rounded value rarely.
    ulp = (want.float().abs() * 2.0 ** -(7 if want.dtype == torch.bfloat16 else 10)).clamp_min(1e-30)
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= ulp).all()) and (diff > 0).float().mean().item() <= 1e-3


# -- every device: the interpreter on the CPU, compiled on a GPU --------------------------------

#: Without a GPU, a case runs only where the kernel launches at most this many programs: Triton's
#: interpreter runs them one after another (about 0.1 s of CPU a program for the four calls of a case).
CPU_MAX_PROGRAMS = 24


def _small_cases() -> list[object]:
    """Every config on every shape in both dtypes. Without a GPU (Triton's interpreter) half of
    them, the dtype alternating along the grid (every config meets every shape and both dtypes),
    and of those only the ones within CPU_MAX_PROGRAMS; the rest run on a GPU only."""
    cases = []
    for i, config in enumerate(CONFIGS):
        name = "chosen" if config is None else f"n{config.block_n}-k{config.block_k}-s{config.split_k}"
        for j, (n, k) in enumerate(SMALL):
            programs = 0 if config is None else -(-n // config.block_n) * config.split_k
            for d, dtype in enumerate((torch.bfloat16, torch.float16)):
                on_cpu = (i + j + d) % 2 == 0 and programs <= CPU_MAX_PROGRAMS
                marks = [] if on_cpu else [gpu, needs_gpu]
                cases.append(pytest.param(dtype, n, k, config, id=f"{name}-{n}-{k}-dtype{d}", marks=marks))
    return cases


@pytest.mark.parametrize("dtype,n,k,config", _small_cases())
def test_matches_rms_norm_then_skinny_linear(dtype: torch.dtype, n: int, k: int, config: GemvConfig | None) -> None:
    for m in (1, 2):
        for residual in (True, False):
            x, r, norm_w, w, b = _operands(m, n, k, dtype, seed=m)
            r = r if residual else None
            bias = b if m == 1 else None
            y, normed, res_sum = norm_skinny_linear(x, r, norm_w, EPS, w, bias, config=config, rule=RULE2)
            want_y, want_normed, want_res = _separate(x, r, norm_w, w, bias, config)
            assert torch.equal(res_sum, want_res)
            if r is None:
                assert res_sum is x  # nothing added: the input itself
            _assert_norm_equal(normed, want_normed)
            if not ON_GPU:
                assert torch.equal(y, want_y)
            tol = TOL[dtype]
            torch.testing.assert_close(y, want_y, atol=tol, rtol=tol)
            exact = _float32_reference(x, r, norm_w, w, bias)
            torch.testing.assert_close(y.double(), exact, atol=2 * tol, rtol=2 * tol)


def test_long_rows_are_summed_in_tiles() -> None:
    """A row longer than the row tile is summed tile by tile (another float32 order than
    ``rms_norm``'s): the outputs stay within a unit in the last place."""
    rule = GemvRule(norm_row_tile=64, fma_max_rows=2)
    for m in (1, 2):
        x, r, norm_w, w, b = _operands(m, 9, 200, torch.float16, seed=3)
        y, normed, res_sum = norm_skinny_linear(x, r, norm_w, EPS, w, b, rule=rule)
        want_y, want_normed, want_res = _separate(x, r, norm_w, w, b, rule=rule)
        assert torch.equal(res_sum, want_res)
        torch.testing.assert_close(normed, want_normed, atol=0, rtol=2.0 ** -10)
        torch.testing.assert_close(y, want_y, atol=2e-3, rtol=2e-3)


def test_outputs_go_into_the_callers_buffers_and_strided_rows_are_read() -> None:
    x, r, norm_w, w, b = _operands(2, 8, 64, torch.bfloat16)
    wide = torch.zeros(2, 128, dtype=x.dtype, device=DEVICE)
    wide[:, 32:96] = x  # rows of stride 128
    normed, res_sum = torch.full_like(x, 7.0), torch.full_like(x, 7.0)
    y, got_normed, got_res = norm_skinny_linear(wide[:, 32:96], r, norm_w, EPS, w, b, normed=normed, res_sum=res_sum,
                                                rule=RULE2)
    assert got_normed is normed and got_res is res_sum
    want_y, want_normed, want_res = _separate(x, r, norm_w, w, b)
    assert torch.equal(res_sum, want_res)
    _assert_norm_equal(normed, want_normed)
    torch.testing.assert_close(y, want_y, atol=1.6e-2, rtol=1.6e-2)


def test_bad_inputs_are_refused_by_name() -> None:
    x, r, norm_w, w, b = _operands(2, 8, 64, torch.bfloat16)
    three = torch.zeros(3, 64, dtype=x.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="norm_skinny_linear: x has 2 rows; accepted: at most 1"):
        norm_skinny_linear(x, None, norm_w, EPS, w)  # the default rule
    with pytest.raises(ValueError, match="norm_skinny_linear: x has 3 rows; accepted: at most 2"):
        norm_skinny_linear(three, None, norm_w, EPS, w, rule=RULE2)
    with pytest.raises(ValueError, match="config.kind 'dot'; accepted: 'fma'"):
        norm_skinny_linear(x, r, norm_w, EPS, w, config=GemvConfig("dot", 16, 32), rule=RULE2)
    with pytest.raises(ValueError, match=r"residual shape \(1, 64\)"):
        norm_skinny_linear(x, r[:1], norm_w, EPS, w, rule=RULE2)
    with pytest.raises(ValueError, match=r"norm_weight shape \(32,\)"):
        norm_skinny_linear(x, r, norm_w[:32], EPS, w, rule=RULE2)
    with pytest.raises(ValueError, match="normed shape"):
        norm_skinny_linear(x, r, norm_w, EPS, w, normed=torch.empty(2, 32, dtype=x.dtype, device=DEVICE), rule=RULE2)
    with pytest.raises(ValueError, match="res_sum shape .* dtype torch.float32"):
        norm_skinny_linear(x, r, norm_w, EPS, w, res_sum=torch.empty(2, 64, device=DEVICE), rule=RULE2)
    with pytest.raises(ValueError, match="norm_skinny_linear: dtypes"):
        norm_skinny_linear(x.float(), r.float(), norm_w, EPS, w.float(), rule=RULE2)
    # A rule with more fma rows lets more through.
    y, _, _ = norm_skinny_linear(three, None, norm_w, EPS, w, rule=GemvRule(fma_max_rows=4))
    assert y.shape == (3, 8)


def test_the_layer_kernel_fills_a_pending_norm() -> None:
    x, r, norm_w, w, b = _operands(2, 8, 64, torch.bfloat16, seed=5)
    pending = PendingNorm(x, r, norm_w, EPS, torch.empty_like(x), torch.empty_like(x))
    kernel = SkinnyLinear(max_rows=8, norm_fusion=True, rule=RULE2)
    y = kernel.norm_linear(pending, w, b)
    want_y, want_normed, want_res = _separate(x, r, norm_w, w, b)
    assert torch.equal(pending.res_sum, want_res)
    _assert_norm_equal(pending.normed, want_normed)
    torch.testing.assert_close(y, want_y, atol=1.6e-2, rtol=1.6e-2)
    first = PendingNorm(x, None, norm_w, EPS, torch.empty_like(x), x)  # no residual: res_sum is x
    kernel.norm_linear(first, w, b)
    assert torch.equal(first.res_sum, x)
    _assert_norm_equal(first.normed, rms_norm(x, norm_w, EPS))


class _OnGpu(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` like one on the GPU."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_takes_norm_says_which_inputs_it_takes() -> None:
    w = torch.zeros(40, 64, dtype=torch.bfloat16)
    on_gpu = lambda rows, dtype=torch.bfloat16: torch.zeros(rows, 64, dtype=dtype).as_subclass(_OnGpu)  # noqa: E731
    kernel = SkinnyLinear(max_rows=8, norm_fusion=True)
    assert kernel.norm_max_rows == 1  # the fma kind's rows (the default rule's)
    assert kernel.takes_norm(on_gpu(1), w, None) and not kernel.takes_norm(on_gpu(2), w, None)
    wider = SkinnyLinear(max_rows=8, norm_fusion=True, rule=RULE2)  # a rule with more fma rows
    assert wider.norm_max_rows == 2 and wider.takes_norm(on_gpu(2), w, None)
    assert not wider.takes_norm(on_gpu(3), w, None)
    assert not kernel.takes_norm(torch.zeros(1, 64, dtype=torch.bfloat16), w, None)  # on the CPU
    assert not kernel.takes_norm(on_gpu(1, torch.float32), w.float(), None)  # float32: F.linear
    assert not SkinnyLinear(max_rows=8).takes_norm(on_gpu(1), w, None)  # cuda.norm_fusion off
    assert not SkinnyLinear(max_rows=1, norm_fusion=True, rule=RULE2).takes_norm(on_gpu(2), w, None)  # gemv_max_rows


# -- GPU only: the decode shapes, graphs and PDL -------------------------------------------------

#: (N, K) of the projections after a norm: Qwen3-30B-A3B qkv and router, Llama-3-8B qkv and gate_up.
NORM_SHAPES = [(5120, 2048), (128, 2048), (6144, 4096), (28672, 4096)]


@gpu
@needs_gpu
@pytest.mark.parametrize("n,k", NORM_SHAPES)
def test_decode_shapes_match_the_separate_kernels(n: int, k: int) -> None:
    for m in (1, 2):
        for residual in (True, False):
            x, r, norm_w, w, b = _operands(m, n, k, torch.bfloat16, seed=m)
            r = r if residual else None
            y, normed, res_sum = norm_skinny_linear(x, r, norm_w, EPS, w, b, rule=RULE2)
            want_y, want_normed, want_res = _separate(x, r, norm_w, w, b)
            assert torch.equal(res_sum, want_res)
            _assert_norm_equal(normed, want_normed)
            torch.testing.assert_close(y, want_y, atol=1.6e-2, rtol=1.6e-2)


@gpu
@needs_gpu
@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs sm_90+")
def test_pdl_chain_in_a_graph_is_bit_equal_to_plain_launches() -> None:
    """A decoder-like chain (fused norm + projection, projection back, next fused norm reading the
    previous one's residual sum) captured with PDL gives the bits of plain launches."""
    k = 2048
    layers = [_operands(1, 5120, k, torch.bfloat16, seed=s) for s in range(4)]
    downs = [(torch.randn(k, 5120, device=DEVICE) / 5120**0.5).to(torch.bfloat16) for _ in layers]
    static_x = layers[0][0].clone()

    def chain(pdl: bool) -> torch.Tensor:
        hidden, residual = static_x, None
        for (_, _, norm_w, w, b), down in zip(layers, downs, strict=True):
            y, _, residual = norm_skinny_linear(hidden, residual, norm_w, EPS, w, b, pdl=pdl)
            hidden = skinny_linear(y, down, pdl=pdl)
        return hidden + residual

    expected = chain(False)
    chain(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
