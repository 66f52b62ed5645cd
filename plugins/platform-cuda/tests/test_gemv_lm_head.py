"""The LM head's skinny GEMM: the model's final RMSNorm folded in bit-equal to the separate norm
(``norm_skinny_linear(exact_norm=True)``, ``SkinnyLinear.final_norm_linear``) and float32 logits
equal to the 16-bit ones widened (``out_dtype``).

Without a GPU every kernel runs in Triton's interpreter, whose ``rms_norm`` sums a row with numpy;
there ``exact_norm`` sums the row in one tile, as numpy does, and is bit-equal to ``rms_norm``
then ``skinny_linear`` on any input. Compiled, ``exact_norm`` adds the squares in the order
``rms_norm`` compiled does (``gemv_tiles._rms_tree_sum``): that code is run here in the
interpreter too, against a model of the compiled order (``test_lm_head_sm90_compile.py`` checks
the model against the PTX), and, on inputs whose sums are exact in any order, end to end against
the separate kernels. On a GPU (``-m gpu``) the fold is checked bit for bit at LM-head shapes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from engine_platform_cuda import gemv
from engine_platform_cuda.gemv import (
    GemvConfig,
    GemvRule,
    exact_norm_applies,
    norm_skinny_linear,
    skinny_linear,
)
from engine_platform_cuda.gemv_layer import SkinnyLinear
from engine_platform_cuda.gemv_tiles import _rms_tree_sum
from engine_platform_cuda.kernels import rms_norm, rms_norm_sum_order

from engine.layers.layernorm import PendingNorm

ON_GPU = torch.cuda.is_available() and torch.version.hip is None
DEVICE = "cuda" if ON_GPU else "cpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16]
#: The fma kind at 2 rows too (a tuned rule may take them; the default takes 1).
RULE2 = GemvRule(fma_max_rows=2)


def _draw(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=DEVICE) * scale


def _wide(m: int, k: int, seed: int) -> torch.Tensor:
    """Normal values scaled by powers of two from 2**-6 to 2**6: their squares span more than
    float32's 24 bits, so partial sums round and the order of adding shows in the sum."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1000)
    return _draw(m, k, seed=seed) * torch.exp2(torch.randint(-6, 7, (m, k), generator=gen, device=DEVICE).float())


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    x, r = _wide(m, k, seed=seed).to(dtype), _wide(m, k, seed=seed + 1).to(dtype)
    norm_w = (1.0 + 0.2 * _draw(k, seed=seed + 2)).to(dtype)
    w = (_draw(n, k, seed=seed + 3) / k**0.5).to(dtype)
    return x, r, norm_w, w


def _dyadic(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values in {±0.5, ±1, ±1.5, ±2}: with a residual of the same kind, the squares of their sums
    add up exactly in float32 in any order (quarters, below 2**20)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randint(1, 5, (m, k), generator=gen, device=DEVICE) * 0.5
            * (torch.randint(0, 2, (m, k), generator=gen, device=DEVICE) * 2 - 1)).to(dtype)


def _separate(x: torch.Tensor, r: torch.Tensor | None, norm_w: torch.Tensor, w: torch.Tensor, pdl: bool = False,
              rule: GemvRule = RULE2, config: GemvConfig | None = None) -> tuple[torch.Tensor, ...]:
    """What the fold replaces: ``rms_norm``, then ``skinny_linear`` and ``.float()`` (the logits)."""
    out = rms_norm(x, norm_w, EPS, r, trigger=pdl)
    normed, res_sum = (out, x) if r is None else out
    return skinny_linear(normed, w, pdl=pdl, rule=rule, config=config).float(), normed, res_sum


# -- the order of rms_norm's sum --------------------------------------------------------------------

@triton.jit
def _tree_sum_kernel(x_ptr, r_ptr, out_ptr, M, stride_xm, stride_rm, K: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK_M: tl.constexpr, TREE_W: tl.constexpr, TREE_V: tl.constexpr,
                     TREE_STEPS: tl.constexpr):
    total = _rms_tree_sum(x_ptr, r_ptr, M, stride_xm, stride_rm, K, HAS_RES, BLOCK_M, TREE_W, TREE_V, TREE_STEPS)
    rows = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + rows, total, mask=rows < M)


def _compiled_order_sum(values: torch.Tensor, order: tuple[int, int, int]) -> torch.Tensor:
    """The sum of squares of each row of ``values`` as ``rms_norm`` compiled adds it
    (``rms_norm_sum_order``), one float32 add at a time."""
    warps, vector, steps = order
    m, k = values.shape
    threads = warps * 32
    squares = torch.zeros(m, steps * threads, dtype=torch.float32, device=values.device)
    squares[:, :k] = values.float() ** 2  # exact: 16-bit values
    # Slot (rep, thread, place) -> thread's step rep * vector + place.
    per_thread = squares.view(m, steps // vector, threads, vector).permute(0, 2, 1, 3).reshape(m, threads, steps)
    acc = per_thread[:, :, 0]
    for step in range(1, steps):
        acc = acc + per_thread[:, :, step]
    lanes = acc.view(m, warps, 32)
    while lanes.shape[-1] > 1:  # butterflies: lanes 16 apart first
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    sums = lanes[..., 0]
    while sums.shape[-1] > 1:  # then the warps, half of them apart first
        half = sums.shape[-1] // 2
        sums = sums[:, :half] + sums[:, half:]
    return sums[:, 0]


def test_sum_order_of_rms_norm() -> None:
    assert rms_norm_sum_order(2048) == (8, 8, 8)  # Qwen3-30B-A3B: 8 warps, one 16-byte vector a thread
    assert rms_norm_sum_order(5120) == (16, 8, 16)  # 8192 slots: two vectors a thread
    assert rms_norm_sum_order(896) == (4, 8, 8)
    assert rms_norm_sum_order(64) == (1, 2, 2)
    assert rms_norm_sum_order(32) == (1, 1, 1)
    assert rms_norm_sum_order(16) is None  # a warp's lanes would repeat values
    assert rms_norm_sum_order(200) is None  # not a multiple of 16: the kernel's loads are specialized otherwise


@pytest.mark.parametrize("k", [32, 64, 128, 256, 896, 2048, 5120])
def test_tree_sum_adds_in_the_compiled_order(k: int) -> None:
    order = rms_norm_sum_order(k)
    assert order is not None
    differs = False
    for seed in range(3):
        for m, res in ((1, True), (1, False), (2, True)):
            x = _wide(m, k, seed=seed).to(torch.bfloat16)
            # x + r exact in bf16 (half of x taken off), so the interpreter's rounding plays no part.
            r = -x / 2
            xr = x - x / 2 if res else x
            out = torch.full((m,), -1.0, device=DEVICE)
            _tree_sum_kernel[(1,)](x, r, out, m, x.stride(0), r.stride(0), K=k, HAS_RES=res, BLOCK_M=m,
                                   TREE_W=order[0], TREE_V=order[1], TREE_STEPS=order[2])
            want = _compiled_order_sum(xr, order)
            assert torch.equal(out, want), (k, seed, m, res, out, want)
            differs |= not torch.equal(want, (xr.float() ** 2).sum(-1))
    # The order matters for these values at most sizes: the test would see another one.
    assert differs or k <= 64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(40, 32), (37, 256), (24, 896), (9, 2048)])
def test_exact_norm_in_the_compiled_order_matches_the_separate_kernels(
        dtype: torch.dtype, n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled code path in the interpreter, on inputs whose sums of squares are exact in any
    order: logits, norm output and residual sum bit-equal to ``rms_norm`` then ``skinny_linear``."""
    monkeypatch.setattr(gemv, "_TREE_NORM", True)
    for m, res in ((1, True), (1, False), (2, True)):
        x, r = _dyadic(m, k, dtype, seed=m), _dyadic(m, k, dtype, seed=m + 7)
        _, _, norm_w, w = _operands(m, n, k, dtype, seed=3)
        r = r if res else None
        for config in (None, GemvConfig("fma", 4, 16, split_k=2)):
            y, normed, res_sum = norm_skinny_linear(x, r, norm_w, EPS, w, rule=RULE2, exact_norm=True,
                                                    out_dtype=torch.float32, config=config)
            want_y, want_normed, want_res = _separate(x, r, norm_w, w, config=config)
            assert y.dtype == torch.float32 and torch.equal(y, want_y)
            assert torch.equal(normed, want_normed) and torch.equal(res_sum, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(40, 64), (37, 256), (24, 2048)])
def test_exact_norm_matches_the_separate_kernels(dtype: torch.dtype, n: int, k: int) -> None:
    """On any input (the interpreter's ``rms_norm`` order there), with rows longer than the rule's
    row tile too: ``exact_norm`` sums a row as ``rms_norm`` does, where the plain fold would not."""
    short_tiles = GemvRule(fma_max_rows=2, norm_row_tile=32)
    for seed in range(2):
        for m, res in ((1, True), (1, False), (2, True)):
            x, r, norm_w, w = _operands(m, n, k, dtype, seed=seed)
            r = r if res else None
            for rule, out_dtype in ((RULE2, None), (short_tiles, torch.float32)):
                y, normed, res_sum = norm_skinny_linear(x, r, norm_w, EPS, w, rule=rule, exact_norm=True,
                                                        out_dtype=out_dtype)
                want_y, want_normed, want_res = _separate(x, r, norm_w, w, rule=rule)
                assert y.dtype == (out_dtype or dtype) and torch.equal(y.float(), want_y)
                assert torch.equal(normed, want_normed) and torch.equal(res_sum, want_res)


def test_exact_norm_refuses_rows_it_does_not_know_the_order_for() -> None:
    x, r, norm_w, w = _operands(1, 16, 64, torch.bfloat16)
    assert exact_norm_applies(x, r, norm_w)
    wide = torch.zeros(1, 200, dtype=torch.bfloat16, device=DEVICE)
    odd = _operands(1, 16, 200, torch.bfloat16)
    with pytest.raises(ValueError, match=r"exact_norm with x shape \(1, 200\).*K a multiple of 16"):
        norm_skinny_linear(odd[0], odd[1], odd[2], EPS, odd[3], exact_norm=True)
    shifted = wide[:, 1:65]  # rows 2 bytes past a 16-byte boundary
    assert not exact_norm_applies(shifted, None, None)
    with pytest.raises(ValueError, match="exact_norm"):
        norm_skinny_linear(shifted, None, norm_w, EPS, w, exact_norm=True)
    strided = torch.zeros(2, 72, dtype=torch.bfloat16, device=DEVICE)[:, :64]  # row stride 72
    assert not exact_norm_applies(strided, None, None) and not exact_norm_applies(x, strided[:1], None)
    assert not exact_norm_applies(x, None, torch.zeros(129, dtype=torch.bfloat16, device=DEVICE)[1:65])
    assert not exact_norm_applies(x.float(), None, None)
    # Without exact_norm the plain fold takes them all, as before.
    norm_skinny_linear(shifted, None, norm_w, EPS, w)


# -- float32 output ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,config", [
    (1, None), (1, GemvConfig("fma", 8, 32)), (1, GemvConfig("fma", 4, 16, split_k=3)),
    (4, None), (4, GemvConfig("dot", 16, 32, split_k=2)), (8, None)],
    ids=lambda v: v if isinstance(v, int) else ("chosen" if v is None else f"{v.kind}-s{v.split_k}"))
def test_float32_output_is_the_16_bit_output_widened(dtype: torch.dtype, m: int, config: GemvConfig | None) -> None:
    x, _, _, w = _operands(m, 37, 200, dtype, seed=m)
    for bias in (None, _draw(37, seed=9).to(dtype)):
        want = skinny_linear(x, w, bias, config=config).float()
        got = skinny_linear(x, w, bias, config=config, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and got.shape == (m, 37) and torch.equal(got, want)
        assert skinny_linear(x, w, bias, config=config, out_dtype=dtype).dtype == dtype
    with pytest.raises(ValueError, match=r"skinny_linear: out_dtype torch.float64; accepted: None, .* or torch.float32"):
        skinny_linear(x, w, out_dtype=torch.float64)


def test_float32_output_of_the_plain_norm_fold() -> None:
    x, r, norm_w, w = _operands(1, 37, 200, torch.bfloat16)
    want, _, _ = norm_skinny_linear(x, r, norm_w, EPS, w)
    got, _, _ = norm_skinny_linear(x, r, norm_w, EPS, w, out_dtype=torch.float32)
    assert torch.equal(got, want.float())


# -- the layer kernel ---------------------------------------------------------------------------------

class _OnGpu(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` like one on the GPU."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _pending(x: torch.Tensor, r: torch.Tensor | None, norm_w: torch.Tensor) -> PendingNorm:
    return PendingNorm(x, r, norm_w, EPS, torch.empty_like(x), x if r is None else torch.empty_like(x))


def test_takes_final_norm_says_which_rows_it_takes() -> None:
    w = torch.zeros(40, 64, dtype=torch.bfloat16)

    def on_gpu(rows: int, k: int = 64) -> Any:
        return torch.zeros(rows, k, dtype=torch.bfloat16).as_subclass(_OnGpu)

    kernel = SkinnyLinear(norm_fusion=True, final_norm_fusion=True)
    assert kernel.takes_final_norm(on_gpu(1), w)
    assert not kernel.takes_final_norm(on_gpu(2), w)  # one row only: its logits are the ones wanted
    assert not SkinnyLinear(norm_fusion=True, final_norm_fusion=True, rule=RULE2).takes_final_norm(on_gpu(2), w)
    assert not kernel.takes_final_norm(torch.zeros(1, 64, dtype=torch.bfloat16), w)  # on the CPU
    odd_w = torch.zeros(40, 200, dtype=torch.bfloat16)
    assert not kernel.takes_final_norm(on_gpu(1, 200), odd_w)  # no known sum order
    assert not SkinnyLinear(norm_fusion=True).takes_final_norm(on_gpu(1), w)  # cuda.final_norm_fusion off
    assert not SkinnyLinear(final_norm_fusion=True).takes_final_norm(on_gpu(1), w)  # cuda.norm_fusion off


@pytest.mark.parametrize("res", [True, False])
def test_final_norm_linear_fills_the_pending_norm_and_gives_the_separate_logits(res: bool) -> None:
    x, r, norm_w, w = _operands(1, 40, 256, torch.bfloat16, seed=4)
    r = r if res else None
    kernel = SkinnyLinear(norm_fusion=True, final_norm_fusion=True, float32_out=True)
    want_y, want_normed, want_res = _separate(x, r, norm_w, w)
    for out_dtype in (torch.float32, None):
        pending = _pending(x, r, norm_w)
        y = kernel.final_norm_linear(pending, w, out_dtype=out_dtype)
        assert y.dtype == (out_dtype or torch.bfloat16) and torch.equal(y.float(), want_y)
        assert torch.equal(pending.normed, want_normed) and torch.equal(pending.res_sum, want_res)


def test_final_norm_linear_runs_the_two_kernels_for_a_residual_it_cannot_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    x, r, norm_w, w = _operands(1, 40, 256, torch.bfloat16, seed=5)
    shifted = torch.zeros(1, 257, dtype=torch.bfloat16, device=DEVICE)[:, 1:]
    shifted.copy_(r)  # the same values, 2 bytes past a 16-byte boundary
    calls = []
    monkeypatch.setattr(gemv, "norm_skinny_linear", lambda *a, **kw: calls.append(1))  # must not be called
    kernel = SkinnyLinear(norm_fusion=True, final_norm_fusion=True, float32_out=True)
    pending = _pending(x, shifted, norm_w)
    y = kernel.final_norm_linear(pending, w, out_dtype=torch.float32)
    want_y, want_normed, want_res = _separate(x, r, norm_w, w)
    assert not calls and y.dtype == torch.float32 and torch.equal(y, want_y)
    assert torch.equal(pending.normed, want_normed) and torch.equal(pending.res_sum, want_res)


def test_the_kernel_stores_float32_when_called_with_out_dtype() -> None:
    x, _, _, w = _operands(1, 40, 64, torch.bfloat16)
    kernel = SkinnyLinear(float32_out=True)
    assert torch.equal(kernel(x, w, out_dtype=torch.float32), kernel(x, w).float())


# -- GPU only: LM-head shapes, compiled ---------------------------------------------------------------

#: (vocab, hidden): Qwen3-30B-A3B, Qwen3-0.6B, Qwen3-4B, Llama-3-8B, Qwen2.5-7B, Qwen2.5-14B, the tiny test models.
LM_HEADS = [(151936, 2048), (151936, 1024), (151936, 2560), (128256, 4096), (152064, 3584), (152064, 5120),
            (2048, 256), (2048, 64)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,k", LM_HEADS)
def test_lm_head_fold_is_bit_equal_on_the_gpu(n: int, k: int) -> None:
    from engine_platform_cuda.gemv import supports_pdl

    pdl = supports_pdl()
    for seed in range(4):
        for dtype in DTYPES:
            for res in (True, False):
                x, r, norm_w, w = _operands(1, n, k, dtype, seed=seed)
                x, r = x * (1 + seed), r * (1 + seed) if res else None
                y, normed, res_sum = norm_skinny_linear(x, r, norm_w, EPS, w, pdl=pdl, exact_norm=True,
                                                        out_dtype=torch.float32)
                want_y, want_normed, want_res = _separate(x, r, norm_w, w, pdl=pdl, rule=gemv.RULE)
                assert torch.equal(normed, want_normed), (n, k, seed, dtype, res)
                assert torch.equal(res_sum, want_res) and torch.equal(y, want_y), (n, k, seed, dtype, res)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_float32_logits_are_bit_equal_on_the_gpu(m: int) -> None:
    x, _, _, w = _operands(m, 151936, 2048, torch.bfloat16)
    assert torch.equal(skinny_linear(x, w, out_dtype=torch.float32), skinny_linear(x, w).float())


@pytest.mark.gpu
@needs_gpu
def test_lm_head_fold_in_a_graph_is_bit_equal_to_the_separate_kernels() -> None:
    """Captured with PDL (as a decode graph runs it) after a kernel writing its input."""
    from engine_platform_cuda.gemv import supports_pdl

    pdl = supports_pdl()
    x, r, norm_w, w = _operands(1, 151936, 2048, torch.bfloat16, seed=11)
    down = (_draw(2048, 2048, seed=12) / 2048**0.5).to(torch.bfloat16)
    static = x.clone()

    def step(fold: bool) -> torch.Tensor:
        hidden = skinny_linear(static, down, pdl=pdl)
        if fold:
            y, _, _ = norm_skinny_linear(hidden, r, norm_w, EPS, w, pdl=pdl, exact_norm=True,
                                         out_dtype=torch.float32)
            return y
        return _separate(hidden, r, norm_w, w, pdl=pdl, rule=gemv.RULE)[0]

    expected = step(False)
    step(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
