"""Triton arithmetic of the attention prologue: Qwen3's per-head RMSNorm of q and k, the neox
rotary embedding, and an fp8 KV pool's quantization, rounded step by step as the separate layers'
kernels round them (``RMSNorm``, ``RotaryEmbedding``, ``MHATokenToKVPool.set_kv_buffer``).

Shared by the CUDA platform's one-launch ``qkv_prologue`` and by attention backends that fold the
prologue into their decode kernel (``AttentionBackend.forward_decode_prologue``). The functions
are elementwise: a caller lays heads out as it likes (one head a program, or a GQA group as one
``[heads, head_dim]`` tile) and hands in each element's rotation partner and the head's norm
factor, broadcast to the element's shape.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def head_rms_factor(x, head_dim, eps, AXIS: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` over a head's elements (axis ``AXIS``), in float32."""
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, axis=AXIS) / head_dim + eps)


@triton.jit
def rms_normed(x, w, r):
    """As ``RMSNorm``'s kernel: ``x * r`` rounded to x's dtype, times the weight, rounded."""
    dt = x.dtype
    return (w.to(tl.float32) * (x.to(tl.float32) * r).to(dt).to(tl.float32)).to(dt)


@triton.jit
def neox_rotated(x, xp, c, s, first, in_rot):
    """Neox rotary of ``x`` given its partner ``xp`` (the other half's element) and the float32
    ``c``/``s`` at its frequency, as the rotary kernel writes it (PyTorch's order: the products
    rounded, then the sum); elements past the rotary dimensions (``in_rot`` false) pass through."""
    dt = x.dtype
    xf = x.to(tl.float32)
    xpf = tl.where(first, -xp.to(tl.float32), xp.to(tl.float32))
    rot = ((xf * c).to(dt).to(tl.float32) + (xpf * s).to(dt).to(tl.float32)).to(dt)
    return tl.where(in_rot, rot, x)


@triton.jit
def fp8_saturated(x, inv_scale, fp8_max):
    """As an fp8 pool's ``quantize_kv`` on CUDA: ``x * (1 / scale)`` in float32 (PyTorch divides
    by a host scalar that way), saturated at the format's largest finite value (NaN kept)."""
    y = x.to(tl.float32) * inv_scale
    return tl.minimum(tl.maximum(y, -fp8_max, propagate_nan=tl.PropagateNan.ALL), fp8_max,
                      propagate_nan=tl.PropagateNan.ALL)
