"""``RadixAttention.forward_qkv`` with this platform's ``qkv_prologue`` against the separate
layers (norms, rotary, the backend's KV store), through a real attention backend, at the head
shapes of Llama-3-8B and Qwen3-30B-A3B (TP 1 and 2), on a decode step and on an extend step.

On a GPU: bf16 and float8 KV, the triton, torch_native and flashinfer backends; q as attention
receives it, the KV pool and the attention output must be bit-equal. Without a GPU the kernel
runs in Triton's interpreter on CPU tensors (float32, torch_native), where the separate layers
run PyTorch code: equal within float32 rounding. The engine-level checks (greedy parity with
the kernel on and off, CUDA graphs) are in test_qkv_prologue_gpu.py.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from engine_platform_cuda.kernels import layer_kernels

from engine import plugins
from engine.attention import AttentionContext
from engine.hookspecs import resolve_factory
from engine.layers.layernorm import RMSNorm
from engine.layers.radix_attention import RadixAttention
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, resolve_kv_cache_dtype
from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU and Triton's interpreter is off (TRITON_INTERPRET=1 runs these on CPU)")


@dataclass(frozen=True)
class Shape:
    heads: int  # on this rank
    kv_heads: int
    head_dim: int
    qk_norm: bool
    theta: float


SHAPES = {
    "llama3_8b": Shape(32, 8, 128, False, 500000.0),
    "qwen3_30b_a3b": Shape(32, 4, 128, True, 1000000.0),
    "qwen3_30b_a3b_tp2": Shape(16, 2, 128, True, 1000000.0),
}
LAYER_ID = 1  # held by a pool of one layer starting there, as a second pipeline stage's is


class _Recording:
    """Wraps the backend: keeps the q attention receives and whether it was asked to store K/V."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.q: torch.Tensor | None = None
        self.save_kv_cache: bool | None = None

    def forward(self, q: torch.Tensor, k: Any, v: Any, layer: Any, fb: ForwardBatch,
                save_kv_cache: bool = True) -> torch.Tensor:
        self.q, self.save_kv_cache = q.clone(), save_kv_cache
        return self.backend.forward(q, k, v, layer, fb, save_kv_cache)


def _decode_step(shape: Shape, fused: bool, dtype: torch.dtype, backend_name: str, kv: str = "auto",
                 page_size: int = 1, window: int = -1, seed: int = 0,
                 new: tuple[int, ...] = (1, 1, 1)) -> tuple[torch.Tensor, _Recording, MHATokenToKVPool]:
    """One step of 3 rows (cached prefixes of 0, 7 and 40 tokens) through ``forward_qkv``, every
    layer given the platform's kernels (without ``qkv_prologue`` unless ``fused``): a decode step,
    or with ``new`` other than one token a row, an extend step of that many new tokens a row."""
    gen = torch.Generator().manual_seed(seed)
    H, KV, D = shape.heads, shape.kv_heads, shape.head_dim
    kernels = layer_kernels()
    if not fused:
        del kernels["qkv_prologue"]
    attn = RadixAttention(H, D, D**-0.5, KV, LAYER_ID, sliding_window_size=window)
    kv_dtype = resolve_kv_cache_dtype(kv, dtype)
    if kv != "auto":
        attn.k_scale, attn.v_scale = 0.0371, 0.0219
    rope = RotaryEmbedding(D, D, 8192, shape.theta).to(DEVICE)
    q_norm = k_norm = None
    if shape.qk_norm:
        q_norm, k_norm = RMSNorm(D, 1e-6).to(DEVICE), RMSNorm(D, 1e-6).to(DEVICE)
        q_norm.weight.data = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype).to(DEVICE)
        k_norm.weight.data = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype).to(DEVICE)
    for module in (attn, rope, q_norm, k_norm):
        if module is not None:
            module.use_kernels(kernels)
    prefix = [0, 7, 40]
    seq = [p + n for p, n in zip(prefix, new)]
    rows = 256
    r2t = ReqToTokenPool(4, 128, DEVICE)
    pool = MHATokenToKVPool(rows, page_size, kv_dtype, KV, D, 1, DEVICE, start_layer=LAYER_ID)
    pool.use_kernels(kernels)
    # Each row's tokens on pages of its own, scattered (page p of row i at (2 + 3 * i + ...)).
    loc_rows = []
    for i, n in enumerate(seq):
        pages = [(1 + 5 * i + 3 * j) % (rows // page_size - 1) + 1 for j in range(-(-n // page_size))]
        slots = torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])[:n]
        r2t.write(i, 0, slots.to(DEVICE))
        loc_rows.append(slots)
    old = torch.cat([s[:p] for s, p in zip(loc_rows, prefix)]).to(DEVICE)
    pool.set_kv_buffer(LAYER_ID, old, torch.randn(len(old), KV, D, generator=gen).to(dtype).to(DEVICE),
                       torch.randn(len(old), KV, D, generator=gen).to(dtype).to(DEVICE), attn.k_scale, attn.v_scale)
    new_loc = torch.cat([s[p:] for s, p in zip(loc_rows, prefix)]).to(DEVICE)
    tokens = sum(new)
    mode = ForwardMode.DECODE if set(new) == {1} else ForwardMode.EXTEND
    fb = ForwardBatch.build(mode, list(range(1, tokens + 1)), [0, 1, 2], seq, prefix, new_loc, DEVICE)
    spec = plugins.get_attention_backend(backend_name)
    ctx = AttentionContext(device=torch.device(DEVICE), dtype=dtype, num_layers=1, num_heads=H, num_kv_heads=KV,
                           head_dim=D, page_size=page_size, max_context_len=128, req_to_token_pool=r2t,
                           token_to_kv_pool=pool, options=plugins.declared_options("attention", backend_name))
    backend = resolve_factory(spec.factory)(ctx)
    recording = _Recording(backend)
    fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = r2t, pool, recording
    backend.init_forward_metadata(fb)
    qkv = (torch.randn(tokens, (H + 2 * KV) * D, generator=gen) * 2).to(dtype).to(DEVICE)
    out = attn.forward_qkv(qkv, fb.positions, fb, rope, q_norm, k_norm)
    assert recording.save_kv_cache is (not fused)  # fused: the kernel stored K/V, attention must not
    return out, recording, pool


def _compare(shape: Shape, dtype: torch.dtype, backend: str, exact: bool, **kw: Any) -> None:
    out, rec, pool = _decode_step(shape, True, dtype, backend, **kw)
    ref_out, ref_rec, ref_pool = _decode_step(shape, False, dtype, backend, **kw)
    pairs = [("q", rec.q, ref_rec.q), ("k cache", pool.k_buffer[0], ref_pool.k_buffer[0]),
             ("v cache", pool.v_buffer[0], ref_pool.v_buffer[0]), ("attention output", out, ref_out)]
    for what, got, ref in pairs:
        assert got is not None and ref is not None
        if exact:
            assert torch.equal(got.float(), ref.float()), f"{what}: max diff {(got.float() - ref.float()).abs().max()}"
        else:
            torch.testing.assert_close(got.float(), ref.float(), atol=2e-5, rtol=1e-5, msg=what)


@pytest.mark.parametrize("name", list(SHAPES))
def test_decode_step_matches_the_separate_layers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        # The interpreter runs the kernel on CPU tensors; the separate layers run PyTorch there.
        monkeypatch.setattr(RadixAttention, "prologue_device_type", "cpu")
        _compare(SHAPES[name], torch.float32, "torch_native", exact=False)
    else:
        _compare(SHAPES[name], torch.bfloat16, "triton", exact=True)


#: Without a GPU the extend step (the interpreter runs 17 tokens x 40 heads programs a step) takes
#: one of the two Qwen3 shapes: TP 2's, the same head size, norms and heads per KV head at half the
#: heads; the other runs compiled on a GPU.
_EXTEND_NAMES = [pytest.param(name, marks=[pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs a "
                 "CUDA GPU")]) if name == "qwen3_30b_a3b" else name for name in SHAPES]


@pytest.mark.parametrize("many_token_kernel", [False, True], ids=["head_a_program", "heads_a_program"])
@pytest.mark.parametrize("name", _EXTEND_NAMES)
def test_extend_step_matches_the_separate_layers(name: str, many_token_kernel: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill step (5, 3 and 9 new tokens on the cached prefixes) takes the fused prologue too,
    with either kernel."""
    from engine_platform_cuda import prologue

    if many_token_kernel:
        monkeypatch.setattr(prologue, "PREFILL_MIN_TOKENS", 1)
    if DEVICE == "cpu":
        monkeypatch.setattr(RadixAttention, "prologue_device_type", "cpu")
        _compare(SHAPES[name], torch.float32, "torch_native", exact=False, new=(5, 3, 9))
    else:
        _compare(SHAPES[name], torch.bfloat16, "triton", exact=True, new=(5, 3, 9))


_GPU_CASES = [
    ("triton", "auto", 1, -1), ("triton", "fp8_e4m3", 1, -1), ("triton", "fp8_e5m2", 16, -1),
    ("triton", "auto", 16, 8), ("torch_native", "auto", 1, 8), ("torch_native", "fp8_e4m3", 4, -1),
    ("flashinfer", "auto", 16, -1), ("flashinfer", "fp8_e4m3", 1, -1),
]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend,kv,page_size,window", _GPU_CASES)
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("new", [(1, 1, 1), (5, 3, 9)], ids=["decode", "extend"])
def test_cuda_step_is_bit_equal(new: tuple[int, ...], dtype: torch.dtype, name: str, backend: str, kv: str,
                                page_size: int, window: int) -> None:
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    _compare(SHAPES[name], dtype, backend, exact=True, kv=kv, page_size=page_size, window=window, new=new)
