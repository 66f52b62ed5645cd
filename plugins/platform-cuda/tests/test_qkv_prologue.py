"""The fused decode prologue (``prologue.qkv_prologue``) against the separate kernels it replaces
and against the PyTorch layers.

Without a GPU the kernels run in Triton's interpreter (the root conftest sets
``TRITON_INTERPRET=1``) on CPU tensors; on a GPU the same tests run compiled on CUDA tensors.
Against the separate kernels (``rms_norm``, ``rotary_qk_inplace``, the pool's write) the
results must be bit-equal: the fused kernel performs the same roundings in the same order
(float32 activations on a GPU: within one float32 ulp, as the compiler may contract a product
and a sum into an FMA in either kernel). Against the PyTorch layers they agree within the
dtype's tolerance (the interpreter truncates where a GPU rounds to nearest).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from engine_platform_cuda.kernels import layer_kernels, rms_norm, rotary_qk_inplace
from engine_platform_cuda.prologue import qkv_prologue

from engine.layers.layernorm import RMSNorm
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.mem_cache.memory_pool import MHATokenToKVPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU and Triton's interpreter is off (TRITON_INTERPRET=1 runs these on CPU)")

_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# (q heads, kv heads, head_dim, rotary_dim, v_head_dim)
SHAPES = [(4, 2, 64, 64, 64), (4, 2, 64, 32, 64), (2, 1, 32, 16, 48)]
DTYPES = [torch.bfloat16, torch.float32] + ([torch.float16] if DEVICE == "cuda" else [])


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(out_ptr.dtype.element_ty), mask=mask)


def _triton_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` by Triton's conversion (the interpreter's float8 rounding is its own)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _cast_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    return out


def _pool_write(pool: MHATokenToKVPool, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: float,
                v_scale: float) -> None:
    """The unfused store: the pool's own ``set_kv_buffer`` (its ``store_kv`` kernel on CUDA). In the
    interpreter, a float8 pool's expected bits are the pool's arithmetic on CUDA (``x * (1 / scale)``
    in float32, PyTorch's division by a host scalar there, then saturation) cast by Triton."""
    if DEVICE == "cuda" or not pool.is_fp8:
        pool.set_kv_buffer(0, loc, k, v, k_scale, v_scale)
        return
    limit = torch.finfo(pool.dtype).max
    for buf, x, scale in ((pool.k_buffer[0], k, k_scale), (pool.v_buffer[0], v, v_scale)):
        y = (x.float() * float(np.float32(1.0) / np.float32(scale))).clamp(-limit, limit)
        buf[loc] = _triton_cast(y, pool.dtype)


class _Case:
    """Random inputs of one case: a fused qkv row per token (``pad`` extra columns per row, so
    the views' row stride is not their width), positions, distinct KV slots, norm weights."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, norm: bool, kv: str, tokens: int = 5,
                 pad: int = 8, seed: int = 0) -> None:
        self.heads, self.kv_heads, self.head_dim, self.rotary_dim, self.v_dim = shape
        self.dtype, self.norm, self.tokens = dtype, norm, tokens
        self.kv_dtype = _FP8.get(kv, dtype)
        gen = torch.Generator().manual_seed(seed)
        q_size, k_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        width = q_size + k_size + self.kv_heads * self.v_dim
        buf = (torch.randn(tokens, width + pad, generator=gen) * 2).to(dtype)
        if kv != "auto":
            buf[0, q_size + k_size] = 1e4  # a value past the float8 range: the store must saturate
        self.buf = buf.to(DEVICE)
        self.positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
        self.loc = (torch.randperm(60, generator=gen)[:tokens] + 1).to(DEVICE)
        self.q_w = (torch.randn(self.head_dim, generator=gen)).to(dtype).to(DEVICE) if norm else None
        self.k_w = (torch.randn(self.head_dim, generator=gen)).to(dtype).to(DEVICE) if norm else None
        self.rope = RotaryEmbedding(self.head_dim, self.rotary_dim, 4096, 10000.0).to(DEVICE)
        self.k_scale, self.v_scale = (0.37, 0.0219) if kv != "auto" else (1.0, 1.0)
        self.eps = 1e-6

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_size, k_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (buf[:, :q_size], buf[:, q_size : q_size + k_size],
                buf[:, q_size + k_size : q_size + k_size + self.kv_heads * self.v_dim])

    def pool(self) -> MHATokenToKVPool:
        pool = MHATokenToKVPool(64, 1, self.kv_dtype, self.kv_heads, self.head_dim, 1, DEVICE, v_head_dim=self.v_dim)
        pool.use_kernels(layer_kernels())
        for b in pool.k_buffer + pool.v_buffer:  # slots not written must keep this
            b.copy_(torch.full(b.shape, 3.0).to(b.dtype))
        return pool

    def fused(self) -> tuple[torch.Tensor, MHATokenToKVPool]:
        buf = self.buf.clone()
        q, k, v = self.views(buf)
        pool = self.pool()
        qkv_prologue(self.positions, q, k, v, pool.k_buffer[0], pool.v_buffer[0], self.loc, self.rope.cos_cache,
                     self.rope.sin_cache, self.rotary_dim, self.q_w, self.k_w, self.eps, self.k_scale, self.v_scale)
        assert torch.equal(buf[:, q.shape[1]:], self.buf[:, q.shape[1]:])  # only q is written in place
        return q, pool

    def separate_kernels(self) -> tuple[torch.Tensor, MHATokenToKVPool]:
        """What a decode step ran before: the norms, the rotary kernel, the pool's write."""
        buf = self.buf.clone()
        q, k, v = self.views(buf)
        if self.norm:
            q = rms_norm(q.reshape(-1, self.head_dim), self.q_w, self.eps).view(q.shape)
            k = rms_norm(k.reshape(-1, self.head_dim), self.k_w, self.eps).view(k.shape)
        rotary_qk_inplace(self.positions, q, k, self.rope.cos_cache, self.rope.sin_cache, self.head_dim,
                          self.rotary_dim)
        pool = self.pool()
        _pool_write(pool, self.loc, k.reshape(self.tokens, self.kv_heads, self.head_dim),
                    v.reshape(self.tokens, self.kv_heads, self.v_dim), self.k_scale, self.v_scale)
        return q, pool

    def torch_layers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v from the PyTorch layers (no kernels), before any KV quantization."""
        q, k, v = self.views(self.buf.clone())
        if self.norm:
            norms = []
            for w in (self.q_w, self.k_w):
                n = RMSNorm(self.head_dim, self.eps).to(DEVICE)
                n.weight.data = w
                norms.append(n)
            q = norms[0](q.reshape(-1, self.head_dim)).view(q.shape)
            k = norms[1](k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rope(self.positions, q.contiguous(), k.contiguous())
        return q, k, v


def _assert_same(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    if got.dtype == torch.float32 and DEVICE == "cuda":
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6, msg=what)
    else:
        assert torch.equal(got.float(), ref.float()), f"{what}: max diff {(got.float() - ref.float()).abs().max()}"


_GPU = [pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")]


def _grid(kvs: list[str]) -> list[object]:
    """dtype x shape x norm x kv. Without a GPU (Triton's interpreter, 0.3-1.5 s a case) half of it,
    the dtype alternating along the grid: every shape x norm x kv in one dtype, and every pair of
    values (a dtype with each shape, norm and kv) still meets; the GPU runs the whole grid."""
    cases = []
    for d, dtype in enumerate(DTYPES):
        for i, shape in enumerate(SHAPES):
            for j, norm in enumerate((False, True)):
                for m, kv in enumerate(kvs):
                    name = "{}-h{}kv{}d{}rot{}v{}-{}-{}".format(dtype, *shape, "qk_norm" if norm else "no_norm", kv)
                    marks = [] if (d + i + j + m) % 2 == 0 else _GPU
                    cases.append(pytest.param(dtype, shape, norm, kv, marks=marks, id=name))
    return cases


@pytest.mark.parametrize("dtype,shape,norm,kv", _grid(["auto", "fp8_e4m3", "fp8_e5m2"]))
def test_equals_the_separate_kernels(dtype: torch.dtype, shape: tuple[int, ...], norm: bool, kv: str) -> None:
    case = _Case(shape, dtype, norm, kv)
    q, pool = case.fused()
    ref_q, ref_pool = case.separate_kernels()
    _assert_same(q, ref_q, "q")
    _assert_same(pool.k_buffer[0], ref_pool.k_buffer[0], "k cache")
    _assert_same(pool.v_buffer[0], ref_pool.v_buffer[0], "v cache")
    if kv != "auto":
        assert pool.v_buffer[0][case.loc[0], 0, 0].float() == torch.finfo(case.kv_dtype).max  # saturated


@pytest.mark.parametrize("dtype,shape,norm,kv", _grid(["auto", "fp8_e4m3"]))
def test_many_token_kernel_equals_the_separate_kernels(dtype: torch.dtype, shape: tuple[int, ...], norm: bool,
                                                       kv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill kernel (several heads a program) at a size that takes it here: four heads a
    program, so a token's last group is partial (6 or 3 heads) and the q/k boundary falls inside
    a group."""
    from engine_platform_cuda import prologue

    monkeypatch.setattr(prologue, "PREFILL_MIN_TOKENS", 4)
    monkeypatch.setattr(prologue, "PREFILL_HEADS", 4)
    launched = []
    real = prologue._qkv_prologue_tokens_kernel
    monkeypatch.setattr(prologue, "_qkv_prologue_tokens_kernel",
                        type("Spy", (), {"__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    case = _Case(shape, dtype, norm, kv, tokens=7)
    q, pool = case.fused()
    assert launched == [(7, -(-(case.heads + case.kv_heads) // 4))]
    ref_q, ref_pool = case.separate_kernels()
    _assert_same(q, ref_q, "q")
    _assert_same(pool.k_buffer[0], ref_pool.k_buffer[0], "k cache")
    _assert_same(pool.v_buffer[0], ref_pool.v_buffer[0], "v cache")


# The interpreter truncates to bf16 where PyTorch rounds: a few ulps apart after the norm and rotary.
_TOL = {torch.bfloat16: dict(atol=6e-2, rtol=3e-2), torch.float16: dict(atol=4e-3, rtol=2e-3),
        torch.float32: dict(atol=2e-5, rtol=1e-5)}


@pytest.mark.parametrize("norm", [False, True], ids=["no_norm", "qk_norm"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}rot{}v{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_pytorch_layers(dtype: torch.dtype, shape: tuple[int, ...], norm: bool) -> None:
    case = _Case(shape, dtype, norm, "auto")
    q, pool = case.fused()
    ref_q, ref_k, ref_v = case.torch_layers()
    torch.testing.assert_close(q, ref_q, **_TOL[dtype])
    loc = case.loc
    torch.testing.assert_close(pool.k_buffer[0][loc].reshape(case.tokens, -1), ref_k, **_TOL[dtype])
    assert torch.equal(pool.v_buffer[0][loc].reshape(case.tokens, -1), ref_v)
    untouched = torch.ones(pool.k_buffer[0].shape[0], dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert (pool.k_buffer[0][untouched] == 3.0).all() and (pool.v_buffer[0][untouched] == 3.0).all()


def test_float8_store_scales_and_saturates_like_the_pool() -> None:
    """Past the rounding: stored * scale recovers k and v to float8 precision, saturated ones excepted."""
    case = _Case((4, 2, 64, 64, 64), torch.float32, False, "fp8_e4m3")
    _, pool = case.fused()
    _, ref_k, ref_v = case.torch_layers()
    for buf, ref, scale in ((pool.k_buffer[0], ref_k, case.k_scale), (pool.v_buffer[0], ref_v, case.v_scale)):
        got = buf[case.loc].float().reshape(case.tokens, -1) * scale
        limit = torch.finfo(torch.float8_e4m3fn).max * scale
        inside = ref.abs() < limit
        assert (got[~inside].abs() == limit).all()
        got, ref = got[inside], ref[inside]
        bar = ref.abs() / 16 + 2 ** -9 * scale  # 3 mantissa bits, round to nearest (+ the subnormal step)
        ok = (got - ref).abs() <= bar
        if DEVICE == "cpu":
            # The interpreter's rounding drops the carry into the exponent (1.1111b rounds to 1.000b
            # of the same binade): half the right value. Those and only those are let through.
            ok |= (2 * got - ref).abs() <= bar
        assert ok.all(), f"stored * scale off by more than float8 rounding: {got[~ok]} vs {ref[~ok]}"


def test_refuses_inputs_it_cannot_store() -> None:
    case = _Case((4, 2, 64, 64, 64), torch.float32, True, "auto")
    q, k, v = case.views(case.buf.clone())
    pool = case.pool()
    args: dict[str, Any] = dict(positions=case.positions, q=q, k=k, v=v, k_cache=pool.k_buffer[0],
                                v_cache=pool.v_buffer[0], loc=case.loc, cos_cache=case.rope.cos_cache,
                                sin_cache=case.rope.sin_cache, rotary_dim=64)
    with pytest.raises(ValueError, match="q_norm_weight and k_norm_weight are given together"):
        qkv_prologue(**args, q_norm_weight=case.q_w)
    with pytest.raises(ValueError, match="rotary_dim 65; accepted: an even number in 2..64"):
        qkv_prologue(**{**args, "rotary_dim": 65})
    with pytest.raises(ValueError, match="5 tokens but 5 positions and 4 KV slots"):
        qkv_prologue(**{**args, "loc": case.loc[:4]})
    with pytest.raises(ValueError, match=r"KV cache of torch.float16 for torch.float32 activations"):
        qkv_prologue(**{**args, "k_cache": pool.k_buffer[0].half(), "v_cache": pool.v_buffer[0].half()})
    with pytest.raises(ValueError, match=r"do not fit 2 KV heads of dims 64/64"):
        qkv_prologue(**{**args, "k": k[:, :64]})


def test_offered_under_its_name_unless_turned_off() -> None:
    from engine_platform_cuda.platform import CudaPlatform

    from engine import plugins
    from engine.cli import build_server_args
    from engine.errors import ConfigError

    assert layer_kernels()["qkv_prologue"] is qkv_prologue
    assert "qkv_prologue" not in layer_kernels(qkv_prologue=False)
    offered = CudaPlatform().layer_kernels()["qkv_prologue"]
    # With programmatic dependent launch (sm_90+) the platform binds pdl=True; without it, plain.
    assert offered is qkv_prologue or (isinstance(offered, functools.partial) and offered.func is qkv_prologue
                                       and offered.keywords == {"pdl": True}), offered
    args = build_server_args({"plugin_option": ["cuda.qkv_prologue=off"]})
    assert args.plugin_options == {"cuda": {"qkv_prologue": False}}
    plugins.check_plugin_options(args.plugin_options)
    off = CudaPlatform(options=args.plugin_options["cuda"]).layer_kernels()
    assert "qkv_prologue" not in off and "rotary_qk_inplace" in off and "store_kv" in off
    with pytest.raises(ConfigError, match=r"cuda\.qkv_prologue: invalid value 'sometimes'; accepted: on/true or off/false"):
        CudaPlatform(options={"qkv_prologue": "sometimes"})
