"""``RadixAttention.forward_qkv``: the fused prologue (decode, extend and mixed batches) is taken
only where it applies, and gives what the separate layers give.

The platform's kernel is stood in for by ``_torch_prologue``, a PyTorch implementation of the
``qkv_prologue`` contract (``Platform.layer_kernels``) built from the layers' own code; the real
Triton kernel is tested against the separate kernels in plugins/platform-cuda/tests.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.attention.base import AttentionBackend, AttentionLayerInfo
from engine.layers.layernorm import RMSNorm
from engine.layers.radix_attention import RadixAttention
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.mem_cache.memory_pool import MHATokenToKVPool, quantize_kv
from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

H, HKV, D, ROT = 4, 2, 16, 8


class _Prologue:
    """``qkv_prologue`` in PyTorch: per-head norm, rotary, q in place, K/V stored at ``loc``."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor, rotary_dim: int, q_norm_weight: torch.Tensor | None = None,
                 k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        self.calls += 1
        head_dim = k_cache.shape[-1]
        if q_norm_weight is not None and k_norm_weight is not None:
            q_norm, k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
            q_norm.weight.data, k_norm.weight.data = q_norm_weight, k_norm_weight
            q_rows = q_norm(q.reshape(-1, head_dim)).view(q.shape)
            k_rows = k_norm(k.reshape(-1, head_dim)).view(k.shape)
        else:
            q_rows, k_rows = q, k
        rope = RotaryEmbedding(head_dim, rotary_dim, 1, 10000.0)
        rope.cos_cache, rope.sin_cache = cos_cache, sin_cache
        q_rot, k_rot = rope(positions, q_rows, k_rows)
        q.copy_(q_rot)
        shape = (-1, k_cache.shape[1], head_dim)
        k_cache[loc] = quantize_kv(k_rot.reshape(shape), k_cache.dtype, k_scale)
        v_cache[loc] = quantize_kv(v.reshape(shape), v_cache.dtype, v_scale)


class _Backend(AttentionBackend):
    """Records what attention receives; "attends" by returning q (the pool is checked apart)."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, bool, bool]] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pass

    def _record(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: AttentionLayerInfo,
                forward_batch: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        self.seen.append((q.clone(), k is None, save_kv_cache))
        return q.clone()

    forward_extend = _record
    forward_decode = _record


class _Layer:
    """A Qwen3-like attention layer's pieces (``norms``: q_norm/k_norm, else Llama-like)."""

    def __init__(self, norms: bool, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.attn = RadixAttention(H, D, D**-0.5, HKV, layer_id=0)
        self.rope = RotaryEmbedding(D, ROT, 64, 10000.0)
        self.q_norm = self.k_norm = None
        if norms:
            self.q_norm, self.k_norm = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
            self.q_norm.weight.data = torch.randn(D, generator=gen).to(dtype)
            self.k_norm.weight.data = torch.randn(D, generator=gen).to(dtype)
        self.qkv = torch.randn(3, (H + 2 * HKV) * D, generator=gen).to(dtype)

    def run(self, mode: ForwardMode, kv_dtype: torch.dtype, kernel: Any, **attn: Any) -> tuple[Any, ...]:
        """One forward_qkv on a 3-token batch of ``mode``; returns (output, pool, backend)."""
        for key, value in attn.items():
            setattr(self.attn, key, value)
        self.attn.use_kernels({"qkv_prologue": kernel} if kernel is not None else {})
        pool = MHATokenToKVPool(32, 1, kv_dtype, HKV, D, 1, "cpu")
        if mode == ForwardMode.DECODE:
            fb = ForwardBatch.build(mode, [5, 6, 7], [0, 1, 2], [9, 3, 30], [8, 2, 29], torch.tensor([4, 17, 9]), "cpu")
        else:
            fb = ForwardBatch.build(mode, [5, 6, 7], [0], [3], [0], torch.tensor([4, 17, 9]), "cpu")
        backend = _Backend()
        fb.token_to_kv_pool, fb.attn_backend = pool, backend
        out = self.attn.forward_qkv(self.qkv.clone(), fb.positions, fb, self.rope, self.q_norm, self.k_norm)
        return out, pool, backend


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in kernel runs on CPU tensors: let the layer take it there."""
    monkeypatch.setattr(RadixAttention, "prologue_device_type", "cpu")


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED])
@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batches_take_the_fused_prologue_and_match_the_layers(norms: bool, kv_dtype: torch.dtype | None,
                                                              dtype: torch.dtype, mode: ForwardMode) -> None:
    layer = _Layer(norms, dtype)
    kv_dtype = kv_dtype or dtype
    scales = {"k_scale": 0.37, "v_scale": 0.5} if kv_dtype != dtype else {}
    kernel = _Prologue()
    out, pool, backend = layer.run(mode, kv_dtype, kernel, **scales)
    ref_out, ref_pool, ref_backend = layer.run(mode, kv_dtype, None, **scales)
    assert kernel.calls == 1
    (q, k_none, saved), = backend.seen
    assert k_none and not saved  # K/V already in the pool: the backend must not write them again
    assert ref_backend.seen[0][1:] == (False, True)  # the separate layers leave the store to attention
    assert torch.equal(q, ref_backend.seen[0][0]) and torch.equal(out, ref_out)
    for got, ref in zip(pool.k_buffer + pool.v_buffer, ref_pool.k_buffer + ref_pool.v_buffer, strict=True):
        assert torch.equal(got.float(), ref.float())
    assert pool.k_buffer[0][torch.tensor([4, 17, 9])].float().abs().sum() > 0  # the new tokens' slots were written


def test_idle_and_tensors_off_the_kernel_device_do_not_take_it() -> None:
    # No monkeypatch: the kernel is declared for CUDA tensors and these are on the CPU.
    layer = _Layer(False, torch.float32)
    kernel = _Prologue()
    layer.run(ForwardMode.DECODE, torch.float32, kernel)
    assert kernel.calls == 0
    fb = ForwardBatch.build(ForwardMode.IDLE, [], [], [], [], torch.empty(0, dtype=torch.int64), "cpu")
    fb.token_to_kv_pool = MHATokenToKVPool(8, 1, torch.float32, HKV, D, 1, "cpu")
    layer.attn.prologue_device_type = "cpu"
    assert not layer.attn.prologue_applies(layer.qkv, fb, layer.rope, None, None)


class _OtherRope(RotaryEmbedding):
    """A rotary embedding with its own math (the kernel knows only RotaryEmbedding's)."""


class _OtherPool(MHATokenToKVPool):
    """A pool of another layout (the kernel writes only the plain K/V buffers)."""


@pytest.mark.usefixtures("on_cpu")
def test_anything_the_kernel_does_not_cover_runs_the_layers() -> None:
    def applies(layer: _Layer, pool: MHATokenToKVPool | None = None, rope: RotaryEmbedding | None = None,
                q_norm: Any = "same", k_norm: Any = "same") -> bool:
        fb = ForwardBatch.build(ForwardMode.DECODE, [5], [0], [3], [2], torch.tensor([4]), "cpu")
        fb.token_to_kv_pool = pool or MHATokenToKVPool(8, 1, torch.float32, HKV, D, 1, "cpu")
        return layer.attn.prologue_applies(layer.qkv, fb, rope or layer.rope,
                                           layer.q_norm if q_norm == "same" else q_norm,
                                           layer.k_norm if k_norm == "same" else k_norm)

    layer = _Layer(True, torch.float32)
    assert not applies(layer)  # no kernel offered
    layer.attn.use_kernels({"qkv_prologue": _Prologue()})
    assert applies(layer)
    assert applies(layer, pool=MHATokenToKVPool(8, 1, torch.float8_e5m2, HKV, D, 1, "cpu"))
    assert not applies(layer, pool=MHATokenToKVPool(8, 1, torch.float16, HKV, D, 1, "cpu"))  # neither dtype nor fp8
    assert not applies(layer, pool=_OtherPool(8, 1, torch.float32, HKV, D, 1, "cpu"))
    assert not applies(layer, rope=_OtherRope(D, ROT, 64, 10000.0))
    assert not applies(layer, rope=RotaryEmbedding(2 * D, ROT, 64, 10000.0))  # another head size
    assert not applies(layer, k_norm=None)  # one norm only
    assert not applies(layer, k_norm=RMSNorm(D, 1e-5))  # two epsilons
    assert not applies(layer, k_norm=RMSNorm(2 * D, 1e-6))
    quantized = RMSNorm(D, 1e-6)
    quantized.out_quant = object()  # type: ignore[assignment]  # its output would come quantized
    assert not applies(layer, q_norm=quantized)
    llama = _Layer(False, torch.float32)
    llama.attn.use_kernels({"qkv_prologue": _Prologue()})
    assert applies(llama)
