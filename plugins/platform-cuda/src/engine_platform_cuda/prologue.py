"""The attention prologue in one Triton launch: per-head RMSNorm of q and k (Qwen3's
``q_norm``/``k_norm``, optional), neox rotary embedding, q rotated in place and K/V written into
the KV pool (quantized for an fp8 pool).

Unfused, a layer launches the norm twice, the rotary kernel and the KV store (four small
latency-bound kernels per layer at decode); this kernel does the same arithmetic in one. At
prefill sizes the unfused path also copied q and k out of the fused qkv output for the per-head
norm and v for attention, and launched a one-warp block per head (294,912 of them for 8,192
tokens of Qwen3-30B-A3B) in both the norm and the rotary kernel; from ``PREFILL_MIN_TOKENS``
tokens a program here takes ``PREFILL_HEADS`` heads of a token instead. It
reproduces the unfused kernels' rounding step by step (``kernels.rms_norm``, ``kernels._rotary_kernel``,
``MHATokenToKVPool.set_kv_buffer``), so outputs are bit-equal to theirs in 16-bit activations.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from engine_platform_cuda.kernels import norm_num_warps

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _head_lanes(head_dim, half, rotary_dim, BLOCK: tl.constexpr):
    """A head's lanes: the element index, whether it is in the head, whether it rotates, whether it
    is in the first half, the element it rotates with (neox: the other half), and its frequency."""
    d = tl.arange(0, BLOCK)
    first = d < half
    return d, d < head_dim, d < rotary_dim, first, tl.where(first, d + half, d - half), tl.where(first, d, d - half)


@triton.jit
def _head_base(q_ptr, k_ptr, qw_ptr, kw_ptr, tok, head, q_heads, stride_q, stride_k, head_dim):
    """Where head ``head`` of token ``tok`` is (heads ``0 .. q_heads - 1`` are q's, the rest k's),
    and its norm weights."""
    if head < q_heads:
        base = q_ptr + tok * stride_q + head * head_dim
        w_ptr = qw_ptr
    else:
        base = k_ptr + tok * stride_k + (head - q_heads) * head_dim
        w_ptr = kw_ptr
    return base, w_ptr


@triton.jit
def _cos_sin(q_ptr, pos_ptr, cos_ptr, sin_ptr, tok, cos_stride, freq, in_rot):
    """The token's cos and sin rows at its position, rounded to the activation dtype as the rotary
    kernel reads them, in float32."""
    dt = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    c = tl.load(cos_ptr + pos * cos_stride + freq, mask=in_rot, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * cos_stride + freq, mask=in_rot, other=0.0).to(dt).to(tl.float32)
    return c, s


@triton.jit
def _norm_weights(w_ptr, d, partner, in_head, in_rot, c, HAS_NORM: tl.constexpr):
    """The head's norm weights at each element and at its rotation partner (``c``, unread, without
    the norm)."""
    w = c
    wp = c
    if HAS_NORM:
        w = tl.load(w_ptr + d, mask=in_head, other=0.0)
        wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0)
    return w, wp


@triton.jit
def _head_prologue(base, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, tok, head, q_heads, c, s,
                   d, in_head, in_rot, first, partner, stride_v, stride_kc, stride_kh, stride_vc, stride_vh,
                   head_dim, v_head_dim, eps, inv_k_scale, inv_v_scale, fp8_max, w, wp,
                   HAS_NORM: tl.constexpr, QUANT: tl.constexpr, BLOCK_V: tl.constexpr):
    """One head of one token, its cos/sin row (``c``, ``s``) and norm weights (``w``, ``wp``: at
    each element and at its rotation partner) loaded: normed, rotated, and q stored in place at
    ``base`` or K (and the V head of the same index) stored at the token's KV slot."""
    dt = base.dtype.element_ty
    x = tl.load(base + d, mask=in_head, other=0.0)
    xp = tl.load(base + partner, mask=in_rot, other=0.0)
    if HAS_NORM:
        # As kernels.rms_norm over one head: normalized value rounded, times the weight, rounded.
        # The partner goes through the same elementwise steps, so it equals the normed value
        # the unfused rotary kernel would read back at its position.
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / head_dim
        r = tl.rsqrt(var + eps)
        x = (w.to(tl.float32) * (xf * r).to(dt).to(tl.float32)).to(dt)
        xp = (wp.to(tl.float32) * (xp.to(tl.float32) * r).to(dt).to(tl.float32)).to(dt)
    xf = x.to(tl.float32)
    xpf = tl.where(first, -xp.to(tl.float32), xp.to(tl.float32))
    # Written as kernels._rotary_kernel writes it (PyTorch's order: products rounded, then the sum);
    # the compiler contracts both alike into one FMA over the rounded partner product
    # (test_qkv_prologue_sm90_compile.py checks it).
    rot = ((xf * c).to(dt).to(tl.float32) + (xpf * s).to(dt).to(tl.float32)).to(dt)
    out = tl.where(in_rot, rot, x)  # dimensions past rotary_dim pass through (normed)
    if head < q_heads:
        tl.store(base + d, out, mask=in_head)
    else:
        kv_head = head - q_heads
        slot = tl.load(loc_ptr + tok).to(tl.int64)
        kval = out
        if QUANT:
            # As the pool's quantize_kv on CUDA: x * (1 / scale) in float32 (PyTorch divides by
            # a host scalar that way), saturated at the format's largest finite value.
            kval = kval.to(tl.float32) * inv_k_scale
            kval = tl.minimum(tl.maximum(kval, -fp8_max, propagate_nan=tl.PropagateNan.ALL), fp8_max,
                              propagate_nan=tl.PropagateNan.ALL)
        tl.store(k_cache_ptr + slot * stride_kc + kv_head * stride_kh + d,
                 kval.to(k_cache_ptr.dtype.element_ty), mask=in_head)
        dv = tl.arange(0, BLOCK_V)
        in_v = dv < v_head_dim
        vval = tl.load(v_ptr + tok * stride_v + kv_head * v_head_dim + dv, mask=in_v, other=0.0)
        if QUANT:
            vval = vval.to(tl.float32) * inv_v_scale
            vval = tl.minimum(tl.maximum(vval, -fp8_max, propagate_nan=tl.PropagateNan.ALL), fp8_max,
                              propagate_nan=tl.PropagateNan.ALL)
        tl.store(v_cache_ptr + slot * stride_vc + kv_head * stride_vh + dv,
                 vval.to(v_cache_ptr.dtype.element_ty), mask=in_v)


@triton.jit
def _qkv_prologue_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, pos_ptr, cos_ptr, sin_ptr,
                         qw_ptr, kw_ptr, stride_q, stride_k, stride_v, stride_kc, stride_kh, stride_vc,
                         stride_vh, q_heads, head_dim, v_head_dim, half, rotary_dim, cos_stride, eps,
                         inv_k_scale, inv_v_scale, fp8_max,
                         HAS_NORM: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
                         PDL: tl.constexpr):
    # A decode step: one program per (token, head): heads 0..q_heads-1 are q's, the rest k's; a k
    # head's program also stores the v head of the same index.
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d, in_head, in_rot, first, partner, freq = _head_lanes(head_dim, half, rotary_dim, BLOCK)
    base, w_ptr = _head_base(q_ptr, k_ptr, qw_ptr, kw_ptr, tok, head, q_heads, stride_q, stride_k, head_dim)
    # Positions, the cos/sin rows and the norm weights are no previous kernel's output: with PDL they
    # load while the qkv projection drains; its output (q, k, v) only after gdc_wait.
    c, s = _cos_sin(q_ptr, pos_ptr, cos_ptr, sin_ptr, tok, cos_stride, freq, in_rot)
    w, wp = _norm_weights(w_ptr, d, partner, in_head, in_rot, c, HAS_NORM)
    if PDL:
        # The attention kernel next may start at once: before its own wait it reads only lengths,
        # slots and the K/V of earlier positions, none of which this kernel or the projection
        # before it writes; this kernel's output only after the wait.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    _head_prologue(base, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, tok, head, q_heads, c, s,
                   d, in_head, in_rot, first, partner, stride_v, stride_kc, stride_kh, stride_vc, stride_vh,
                   head_dim, v_head_dim, eps, inv_k_scale, inv_v_scale, fp8_max, w, wp,
                   HAS_NORM, QUANT, BLOCK_V)


@triton.jit
def _qkv_prologue_tokens_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, pos_ptr, cos_ptr, sin_ptr,
                                qw_ptr, kw_ptr, stride_q, stride_k, stride_v, stride_kc, stride_kh, stride_vc,
                                stride_vh, q_heads, num_heads, head_dim, v_head_dim, half, rotary_dim, cos_stride,
                                eps, inv_k_scale, inv_v_scale, fp8_max,
                                HAS_NORM: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                                BLOCK_V: tl.constexpr, HEADS: tl.constexpr):
    # Many tokens (prefill): program (token, g) takes heads g * HEADS .. of the token (q's, then
    # k's, as above) one after another, with the same per-head arithmetic in the same layout as
    # the decode kernel: each head's results are bit-equal to it. A program a head was a
    # one-warp block of a few hundred bytes; at prefill sizes those blocks' scheduling, not their
    # bytes, set the time.
    tok = tl.program_id(0).to(tl.int64)
    d, in_head, in_rot, first, partner, freq = _head_lanes(head_dim, half, rotary_dim, BLOCK)
    c, s = _cos_sin(q_ptr, pos_ptr, cos_ptr, sin_ptr, tok, cos_stride, freq, in_rot)
    for i in tl.static_range(HEADS):
        head = tl.program_id(1) * HEADS + i
        if head < num_heads:
            base, w_ptr = _head_base(q_ptr, k_ptr, qw_ptr, kw_ptr, tok, head, q_heads, stride_q, stride_k, head_dim)
            w, wp = _norm_weights(w_ptr, d, partner, in_head, in_rot, c, HAS_NORM)
            _head_prologue(base, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, tok, head, q_heads, c, s,
                           d, in_head, in_rot, first, partner, stride_v, stride_kc, stride_kh, stride_vc,
                           stride_vh, head_dim, v_head_dim, eps, inv_k_scale, inv_v_scale, fp8_max, w, wp,
                           HAS_NORM, QUANT, BLOCK_V)


#: Tokens from which ``qkv_prologue`` takes the many-token kernel (heads ``PREFILL_HEADS`` a
#: program). Decode batches (graph sizes) keep a program a head, which the PDL chain was tuned with.
PREFILL_MIN_TOKENS = 512
PREFILL_HEADS = 8


def _reciprocal(scale: float) -> float:
    """``1 / scale`` rounded to float32 as PyTorch's CUDA division by a host scalar computes it."""
    return float(np.float32(1.0) / np.float32(scale))


def qkv_prologue(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor, rotary_dim: int, q_norm_weight: torch.Tensor | None = None,
                 k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, k_scale: float = 1.0,
                 v_scale: float = 1.0, pdl: bool = False) -> None:
    """Norm (optional) and rotary of q and k, q in place, K and V stored at ``loc``, one launch
    (a decode step or a prefill's tokens alike; ``k`` and ``v`` are not changed: attention reads
    the new tokens' K/V from the pool).

    Args:
        positions: ``[tokens]`` position ids (index ``cos_cache``/``sin_cache`` rows).
        q: ``[tokens, heads * head_dim]``, rotated in place; k ``[tokens, kv_heads * head_dim]``
            and v ``[tokens, kv_heads * v_head_dim]`` are read only. Rows may be strided views
            (of the fused qkv output); the last dimension must have unit stride.
        k_cache, v_cache: the layer's pool buffers ``[slots, kv_heads, head_dim | v_head_dim]``;
            their shapes give the head sizes. In q's dtype, or float8: then ``x / scale``,
            saturated, is stored, as ``MHATokenToKVPool.set_kv_buffer`` does.
        loc: ``[tokens]`` KV slots (``out_cache_loc``).
        cos_cache, sin_cache: ``[max_position, rotary_dim // 2]`` (``RotaryEmbedding``'s caches).
        rotary_dim: leading dimensions of each head that rotate (neox half split); the rest pass.
        q_norm_weight, k_norm_weight: ``[head_dim]`` per-head RMSNorm weights, both or neither.
        eps: the norms' epsilon. k_scale, v_scale: an fp8 pool's per-tensor scales.
        pdl: (sm_90+) launch with programmatic dependent launch: positions, cos/sin and the norm
            weights load while the previous kernel drains; q, k and v after it completed.
    """
    tokens = q.shape[0]
    if tokens == 0:
        return
    if k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(f"qkv_prologue: k_cache/v_cache must be [slots, kv_heads, head_dim]; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    kv_heads, head_dim, v_head_dim = k_cache.shape[1], k_cache.shape[2], v_cache.shape[2]
    if q.dim() != 2 or q.shape[1] % head_dim or k.shape != (tokens, kv_heads * head_dim) \
            or v.shape != (tokens, kv_heads * v_head_dim):
        raise ValueError(f"qkv_prologue: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         f"{kv_heads} KV heads of dims {head_dim}/{v_head_dim}; accepted: q [tokens, heads * "
                         f"head_dim], k [tokens, kv_heads * head_dim], v [tokens, kv_heads * v_head_dim]")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)):
        raise ValueError("qkv_prologue: q, k, v and the caches need unit stride in the last dimension")
    if loc.shape[0] != tokens or positions.shape[0] != tokens:
        raise ValueError(f"qkv_prologue: {tokens} tokens but {positions.shape[0]} positions and "
                         f"{loc.shape[0]} KV slots; accepted: one of each per token")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"qkv_prologue: rotary_dim {rotary_dim}; accepted: an even number in 2..{head_dim}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("qkv_prologue: q_norm_weight and k_norm_weight are given together or not at all")
    has_norm = q_norm_weight is not None
    if has_norm:
        assert q_norm_weight is not None and k_norm_weight is not None
        if q_norm_weight.numel() != head_dim or k_norm_weight.numel() != head_dim \
                or q_norm_weight.dtype != k_norm_weight.dtype:
            raise ValueError(f"qkv_prologue: norm weights of {q_norm_weight.numel()} and {k_norm_weight.numel()} "
                             f"elements ({q_norm_weight.dtype}, {k_norm_weight.dtype}); accepted: {head_dim} "
                             "each, one dtype")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"qkv_prologue: k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}; accepted: one dtype")
    quant = k_cache.dtype in _FP8
    if not quant and k_cache.dtype != q.dtype:
        raise ValueError(f"qkv_prologue: KV cache of {k_cache.dtype} for {q.dtype} activations; accepted: "
                         f"{q.dtype} or a float8 type")
    fp8_max = float(torch.finfo(k_cache.dtype).max) if quant else 0.0
    inv_k, inv_v = (_reciprocal(k_scale), _reciprocal(v_scale)) if quant else (1.0, 1.0)
    q_heads = q.shape[1] // head_dim
    qw = q_norm_weight if has_norm else q  # unread without norm; any pointer of one dtype
    kw = k_norm_weight if has_norm else q
    block = triton.next_power_of_2(head_dim)
    common = (q, k, v, k_cache, v_cache, loc, positions, cos_cache, sin_cache, qw, kw,
              q.stride(0), k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
              v_cache.stride(1), q_heads)
    dims = (head_dim, v_head_dim, rotary_dim // 2, rotary_dim, cos_cache.stride(0), eps, inv_k, inv_v, fp8_max)
    flags = {"HAS_NORM": has_norm, "QUANT": quant, "BLOCK": block, "BLOCK_V": triton.next_power_of_2(v_head_dim),
             "num_warps": norm_num_warps(block)}  # as rms_norm's: its sum of squares reduced in the same order
    if tokens >= PREFILL_MIN_TOKENS:
        heads = q_heads + kv_heads
        _qkv_prologue_tokens_kernel[(tokens, triton.cdiv(heads, PREFILL_HEADS))](
            *common, heads, *dims, HEADS=min(PREFILL_HEADS, heads), **flags)
        return
    _qkv_prologue_kernel[(tokens, q_heads + kv_heads)](*common, *dims, PDL=pdl, launch_pdl=pdl, **flags)
