"""Fused Triton kernels for the layer SDK on CUDA: RMSNorm (+residual add), SiLU-and-mul,
neox rotary embedding applied in place (q and k in one launch) and the KV-cache store (the
decode-step attention prologue doing norm, rotary and store at once is in ``prologue.py``).

Each kernel reproduces the rounding of the PyTorch layer it replaces (values are rounded to
the activation dtype where PyTorch rounds), so outputs agree to within one ulp. They replace
several small kernels per layer with one, which matters when a decode step is bound by reading
the weights and every extra launch or pass costs time.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:
        # A kernel launched after this one with PDL (the skinny GEMM) may start now; it waits for
        # this kernel's results before reading them.
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # PyTorch adds in the activation dtype
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    h = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * n_cols + cols, out, mask=mask)


def norm_num_warps(block: int) -> int:
    """Warps of an RMSNorm over rows of ``block`` (a power of two) elements. The fused attention
    prologue (``prologue.py``) normalizes each head with as many, so its sum of squares is reduced
    in the same layout and order as ``rms_norm``'s (bit-equal results)."""
    return min(max(block // 256, 1), 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             trigger: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * norm(x [+ residual])``; with ``residual`` also returns ``x + residual``.
    ``trigger`` (sm_90+): let a kernel launched next with PDL start while this one runs."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    warps = norm_num_warps(block)
    if residual is None:
        _rmsnorm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0, n, eps,
                                        HAS_RESIDUAL=False, BLOCK=block, TRIGGER=trigger, num_warps=warps)
        return out.view(shape)
    r2 = residual.reshape(-1, n)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    res_out = torch.empty_like(out)
    _rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), n, eps,
                                    HAS_RESIDUAL=True, BLOCK=block, TRIGGER=trigger, num_warps=warps)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, d, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the activation dtype
    out = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    tl.store(out_ptr + row * d + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor, trigger: bool = False) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]``; ``trigger`` as for ``rms_norm``."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, x2.stride(0), d, BLOCK=block,
                                                            TRIGGER=trigger, num_warps=4)
    return out.view(*x.shape[:-1], d)


@triton.jit
def _rotary_kernel(x_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, stride_x, stride_y, x_heads, head_dim, half,
                   cos_stride, BLOCK: tl.constexpr):
    # Heads 0..x_heads-1 are x's (q), the rest y's (k): one launch rotates both.
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    if head < x_heads:
        base = x_ptr + tok * stride_x + head * head_dim
    else:
        base = y_ptr + tok * stride_y + (head - x_heads) * head_dim
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + half + offs, mask=mask, other=0.0)
    dt = x1.dtype
    c = tl.load(cos_ptr + pos * cos_stride + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * cos_stride + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    # As PyTorch: each product rounded to the activation dtype, then the sum rounded.
    o1 = ((x1f * c).to(dt).to(tl.float32) + (-x2f * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)).to(dt)
    tl.store(base + offs, o1, mask=mask)
    tl.store(base + half + offs, o2, mask=mask)


def rotary_inplace(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor,
                   sin_cache: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Rotates ``x`` ``[tokens, heads * head_dim]`` (rows may be strided views) in place."""
    rotary_qk_inplace(positions, x, x[:, :0], cos_cache, sin_cache, head_dim, rotary_dim)  # no k heads
    return x


def rotary_qk_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                      sin_cache: torch.Tensor, head_dim: int, rotary_dim: int) -> None:
    """Rotates ``q`` ``[tokens, heads * head_dim]`` and ``k`` ``[tokens, kv_heads * head_dim]``
    (rows may be strided views, e.g. of the fused qkv output) in place, in one launch."""
    tokens = q.shape[0]
    if tokens == 0:
        return
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.shape[0] != tokens:
        raise ValueError("rotary_qk_inplace needs q and k with the same rows and unit stride in the last dimension")
    q_heads, k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    half = rotary_dim // 2
    _rotary_kernel[(tokens, q_heads + k_heads)](
        q, k, positions, cos_cache, sin_cache, q.stride(0), k.stride(0), q_heads, head_dim, half,
        cos_cache.stride(0), BLOCK=triton.next_power_of_2(half), num_warps=1)


@triton.jit
def _store_kv_kernel(k_cache_ptr, v_cache_ptr, loc_ptr, k_ptr, v_ptr, stride_k, stride_v,
                     k_row, v_row, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + tok).to(tl.int64)
    ok = tl.arange(0, BLOCK_K)
    tl.store(k_cache_ptr + slot * k_row + ok, tl.load(k_ptr + tok * stride_k + ok, mask=ok < k_row), mask=ok < k_row)
    ov = tl.arange(0, BLOCK_V)
    tl.store(v_cache_ptr + slot * v_row + ov, tl.load(v_ptr + tok * stride_v + ov, mask=ov < v_row), mask=ov < v_row)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """``k_cache[loc] = k; v_cache[loc] = v`` in one launch.

    Caches are ``[slots, kv_heads, head_dim]`` contiguous; ``k``/``v`` are ``[tokens, kv_heads,
    head_dim]`` with contiguous rows (a row stride may skip, as in views of the qkv output), in
    the cache dtype.
    """
    tokens = loc.shape[0]
    if tokens == 0:
        return
    k_row, v_row = k_cache[0].numel(), v_cache[0].numel()
    # Views when each row is contiguous (a copy otherwise); the row stride is passed on.
    k2, v2 = k.reshape(tokens, -1), v.reshape(tokens, -1)
    if k2.stride(-1) != 1 or v2.stride(-1) != 1:
        raise ValueError("store_kv needs unit stride in the last dimension")
    _store_kv_kernel[(tokens,)](k_cache, v_cache, loc, k2, v2, k2.stride(0), v2.stride(0), k_row, v_row,
                                BLOCK_K=triton.next_power_of_2(k_row), BLOCK_V=triton.next_power_of_2(v_row),
                                num_warps=4)


def layer_kernels(gemv_max_rows: int = 8, qkv_prologue: bool = True, pdl: bool = False,
                  norm_fusion: bool = False, pdl_preload: int | None = None, argmax: bool = False) -> dict[str, Any]:
    """The kernels by ``Platform.layer_kernels`` name; ``linear`` (the skinny GEMM of ``gemv``,
    taken by unquantized linear layers for inputs of at most ``gemv_max_rows`` rows) only when
    ``gemv_max_rows`` > 0; ``qkv_prologue`` (``prologue.py``: q/k norm, rotary and the KV store
    of a decode step in one launch) unless ``qkv_prologue`` is False; ``argmax`` (``argmax.argmax_rows``:
    ``torch.argmax(logits, dim=-1)`` in one launch, for the sampler's greedy rows) when ``argmax``.

    ``pdl`` (sm_90+ only: the instructions do not exist before): the skinny GEMM is launched with
    programmatic dependent launch, and RMSNorm and SiLU-and-mul, which precede it in a layer, let
    it start while they run (``gemv.skinny_linear``). The ``pdl`` entry (a bool, not a kernel)
    tells layers with Triton kernels of their own (``FusedMoE``'s small-batch path) the same.

    ``norm_fusion``: the skinny GEMM also takes the RMSNorm before it (``SkinnyLinear.norm_linear``,
    ``gemv.norm_skinny_linear``), so the layer SDK skips the norm's launch where it takes the rows.

    ``pdl_preload``: with PDL, the K steps of weights each skinny-GEMM program requests before its
    wait (``GemvRule.fma_pdl_steps``); None keeps the rule's."""
    from dataclasses import replace

    from engine_platform_cuda.argmax import argmax_rows
    from engine_platform_cuda.gemv import RULE, SkinnyLinear
    from engine_platform_cuda.prologue import qkv_prologue as prologue_kernel

    # Layers with Triton kernels of their own (the MoE experts) read the flag itself.
    kernels: dict[str, Any] = {"pdl": pdl}
    pdl = pdl and gemv_max_rows > 0  # nothing to start early without the skinny GEMM
    kernels.update({
        "rms_norm": functools.partial(rms_norm, trigger=True) if pdl else rms_norm,
        "silu_and_mul": functools.partial(silu_and_mul, trigger=True) if pdl else silu_and_mul,
        "rotary_inplace": rotary_inplace, "rotary_qk_inplace": rotary_qk_inplace, "store_kv": store_kv})
    if argmax:
        kernels["argmax"] = argmax_rows
    if gemv_max_rows > 0:
        rule = RULE if pdl_preload is None else replace(RULE, fma_pdl_steps=pdl_preload)
        kernels["linear"] = SkinnyLinear(max_rows=gemv_max_rows, pdl=pdl, norm_fusion=norm_fusion, rule=rule)
    if qkv_prologue:
        kernels["qkv_prologue"] = functools.partial(prologue_kernel, pdl=True) if kernels["pdl"] else prologue_kernel
    return kernels
