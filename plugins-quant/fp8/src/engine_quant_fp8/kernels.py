"""Triton kernels of the fp8 plugin (imported only when a CUDA fp8 layer runs, or by tests).

- ``w8a16_linear``: ``y = x @ dequant(W).T (+ bias)`` with an fp8 e4m3 weight ``[N, K]``
  dequantized in registers and 16/32-bit activations, float32 accumulation, output in the
  activation dtype. Two shapes of kernel:

  * a GEMV (``_w8a16_gemv_kernel``) for a handful of tokens: one program per (token, BLOCK_N
    rows); each reads its rows' fp8 codes once with wide coalesced loads, multiplies in float32
    and reduces at the end. Small BLOCK_N gives enough programs to fill every SM without split-K.
  * a tiled ``tl.dot`` GEMM (``_w8a16_gemm_kernel``) for more tokens: the fp8 tile is widened to
    the activation dtype (exact: every e4m3 value is a bf16 and an fp16 value) and fed to the
    tensor cores.

  Scales are per output channel (``scale [N]``, applied once to the accumulator) or per
  ``(bn, bk)`` weight tile (``scale [ceil(N/bn), ceil(K/bk)]``): the GEMV sums each bk-wide group
  of a K step before scaling it, the tl.dot kernel keeps BLOCK_K <= bk (one scale column per step).
- ``quantize_per_token_triton``: dynamic (or static) per-token fp8 quantization of the
  activations in one launch, for ``torch._scaled_mm`` at large M: a row of up to 4,096 values is
  read once and kept in registers; each value's division by the scale is ``_div_rn`` (IEEE
  rounding in a multiply and two fmas).

``K`` (the reduction length) is a compile-time constant: a model has two or three, the loop
bounds are then known to the compiler, and Triton 3.6's interpreter cannot run a ``range`` over a
runtime argument under numpy 2.4 (``int()`` of a 1-element array), which the CPU tests need.

No host syncs and no shape-dependent allocation beyond the output, so the callers stay
capturable in CUDA graphs. Launch parameters come from ``_gemv_config`` / ``_gemm_config``,
tables from H100 sweeps (benchmarks/bench_kernels.py --sweep); ``config=`` overrides them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from engine_quant_fp8.quantize import _MIN_SCALE, FP8_DTYPE, FP8_MAX

# Triton 3.6's interpreter (CPU tests) computes 16-bit tl.dot wrongly: there the tiles are widened
# to float32 first, which on a GPU is the float32-activation path (exact, IEEE products).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

#: Token counts up to this run the GEMV kernel, above it the tl.dot kernel (H100: at M = 4 the
#: best tl.dot config beat the best GEMV on all four Llama shapes, by 1.3-1.7x).
GEMV_MAX_M = 1


@triton.jit
def _w8a16_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K: tl.constexpr,
                       stride_xm, stride_wn, stride_sn, stride_ym,
                       HAS_BIAS: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                       SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # Token index varies fastest, so programs sharing weight rows run together and hit L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    # Clamp out-of-range rows to row 0 instead of masking: loads stay unpredicated and wide.
    rows = tl.where(mask_n, offs_n, 0).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + pid_m.to(tl.int64) * stride_xm + offs_k
    if BLOCK_SCALES:
        # BLOCK_K spans GROUPS scale columns: each step sums its products per column group,
        # then scales the [BLOCK_N, GROUPS] partial sums.
        GROUPS: tl.constexpr = BLOCK_K // SCALE_BK
        acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
        s_ptrs = s_ptr + (rows // SCALE_BN)[:, None] * stride_sn + tl.arange(0, GROUPS)[None, :]
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # The weight streams through once: keep it from evicting the activations in L2.
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs)
        else:
            mask_k = k0 + offs_k < K
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=mask_k, other=0.0)
        prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
        if BLOCK_SCALES:
            part = tl.sum(tl.reshape(prod, [BLOCK_N, GROUPS, SCALE_BK]), axis=2)
            col = k0 // SCALE_BK + tl.arange(0, GROUPS)
            s = tl.load(s_ptrs, mask=(col < tl.cdiv(K, SCALE_BK))[None, :], other=0.0)
            acc += part * s
            s_ptrs += GROUPS
        else:
            acc += prod
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    if not BLOCK_SCALES:
        out = out * tl.load(s_ptr + rows)
    if HAS_BIAS:
        out = out + tl.load(b_ptr + rows).to(tl.float32)
    tl.store(y_ptr + pid_m.to(tl.int64) * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _gemm_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile of the fp8 GEMMs: token and weight-row offsets, their masks, and
    the rows to read (out-of-range ones read row 0, never stored: unpredicated loads)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles sweep the same weight columns while they sit in L2.
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_x = tl.where(mask_m, offs_m, 0).to(tl.int64)
    rows_w = tl.where(mask_n, offs_n, 0).to(tl.int64)
    return offs_m, offs_n, mask_m, mask_n, rows_x, rows_w


@triton.jit
def _w8a16_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr,
                       stride_xm, stride_wn, stride_sn, stride_ym,
                       HAS_BIAS: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                       SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE_DOT: tl.constexpr):
    offs_m, offs_n, mask_m, mask_n, rows_x, rows_w = _gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows_w[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of W.T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            mask_k = k0 + offs_k < K
            x = tl.load(x_ptrs, mask=mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None], other=0.0)
        # e4m3 -> fp16 is exact and native on sm89+ (cvt.f16x2.e4m3x2); fp16 -> bf16 is exact for e4m3
        # values. (Triton 3.6's interpreter also mis-converts e4m3 straight to bf16.)
        w = w.to(tl.float16).to(x_ptr.dtype.element_ty)
        if IEEE_DOT:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w)
        if BLOCK_SCALES:
            s = tl.load(s_ptr + (rows_w // SCALE_BN) * stride_sn + k0 // SCALE_BK)
            acc += part * s[None, :]
        else:
            acc += part
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        acc = acc * tl.load(s_ptr + rows_w)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _div_rn(v, scale, MAY_OVERFLOW: tl.constexpr = False):
    # ``tl.math.div_rn(v, scale)`` for a scalar ``scale``, in a multiply and two fmas an element
    # instead of IEEE division's branching sequence (most of these kernels' arithmetic). With ``r``
    # the correctly rounded 1 / scale and ``q0 = v * r`` within an ulp of v / scale, the residual
    # ``v - q0 * scale`` is exact in an fma and ``q0 + residual * r`` rounds to the correctly rounded
    # quotient (Markstein). Only quotients below float32's normal range (2**-126) may differ, and
    # those quantize to 0 in any 8-bit format: the codes are those of IEEE division (the torch
    # reference, ``quantize.quantize_per_token_reference``). A zero keeps the sign division gives it
    # (the correction would add +0 to -0). ``MAY_OVERFLOW`` (a static scale, which the row's values
    # may exceed by more than float32's range, or an infinite value): an infinite ``q0`` is kept too
    # (the correction would turn it into NaN, not the +-inf that clamps to +-QMAX).
    r = tl.math.div_rn(1.0, scale)
    q0 = v * r
    keep = q0 == 0.0
    if MAY_OVERFLOW:
        keep = keep | (tl.abs(q0) == float("inf"))
    return tl.where(keep, q0, tl.math.fma(tl.math.fma(-q0, scale, v), r, q0))


@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K: tl.constexpr, stride_xm, stride_qm,
                               HAS_STATIC: tl.constexpr, BLOCK_K: tl.constexpr,
                               QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    # Round-to-nearest division and a clamp: the torch reference's maths exactly
    # (a float -> e4m3fn cast saturates to NaN, not to 448).
    if not HAS_STATIC and BLOCK_K >= K:
        # The row fits one block: read once, kept in registers for the codes.
        mask = offs < K
        v = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(v), axis=0) / QMAX, MIN_SCALE)
        tl.store(s_ptr + row, scale)
        q = tl.clamp(_div_rn(v, scale), -QMAX, QMAX)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        if HAS_STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
                amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
            scale = tl.maximum(tl.max(amax, axis=0) / QMAX, MIN_SCALE)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(_div_rn(v, scale, HAS_STATIC), -QMAX, QMAX)
            tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_per_token_triton(x: torch.Tensor,
                              static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token`` in one launch: ``(q [M, K] e4m3fn, scale [M, 1] float32)``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block_k = min(triton.next_power_of_2(k), 4096)
    static = static_scale.reshape(()) if static_scale is not None else scale  # unused when dynamic
    _quantize_per_token_kernel[(m,)](x, q, scale, static, k, x.stride(0), q.stride(0),
                                     HAS_STATIC=static_scale is not None, BLOCK_K=block_k,
                                     QMAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, num_warps=4 if block_k <= 2048 else 8)
    return q, scale


def _gemv_config(m: int, n: int, k: int, blocked: bool) -> dict[str, int]:
    # H100 sweep, M = 1 (benchmarks/bench_kernels.py --sweep): 4 rows x 2048 columns per
    # program for the large weights, 8 x 512-1024 for the 4096/6144-row ones.
    if n * k >= 32 * 1024 * 1024:
        return {"BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 8 if n > k else 4, "num_stages": 1}
    return {"BLOCK_N": 8, "BLOCK_K": 512 if n > 4096 else 1024, "num_warps": 4, "num_stages": 1}


def _gemm_config(m: int, n: int, k: int) -> dict[str, int]:
    # H100 sweep (as above): narrow N tiles keep >= 128 programs on the 4096/6144-row weights at
    # small M; the 28672-row gate_up prefers 128-wide tiles. (Block scales cap BLOCK_K at 128.)
    block_n = 32 if n <= 4096 else 64 if n <= 8192 else 128
    block_k = 128 if block_n == 128 else 256
    if m <= 64:
        block_m = max(16, triton.next_power_of_2(m))
        stages = 3 if block_n == 128 or (block_m == 32 and block_n == 64) else 4
        return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8,
                "num_warps": 4, "num_stages": stages}
    if block_n == 128:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    if m <= 128 and n <= 4096:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 block_size: tuple[int, int] | None = None, config: dict[str, Any] | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` in ``x.dtype``, weight-only (activations unquantized).

    Args:
        x: ``[M, K]`` float32 / bfloat16 / float16.
        weight: ``[N, K]`` float8_e4m3fn with unit stride along K.
        scale: ``[N]`` float32 per channel, or ``[ceil(N/bn), ceil(K/bk)]`` float32 with ``block_size``.
        bias: optional ``[N]``.
        block_size: ``(bn, bk)``, powers of two, for block scales.
        config: launch parameters (``kind`` ``"gemv"`` or ``"gemm"`` and the block sizes), for tuning.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    blocked = block_size is not None
    scale_bn, scale_bk = block_size if blocked else (1, 1)
    if blocked and (scale_bn & (scale_bn - 1) or scale_bk & (scale_bk - 1)):
        raise ValueError(f"w8a16_linear: block_size {block_size} must be powers of two")
    cfg = dict(config) if config else {}
    kind = cfg.pop("kind", "gemv" if m <= GEMV_MAX_M else "gemm")
    if not cfg:
        cfg = _gemv_config(m, n, k, blocked) if kind == "gemv" else _gemm_config(m, n, k)
    if kind == "gemm" and x.element_size() == 4 and not config:
        # float32 activation tiles are twice the 16-bit ones the tables were tuned for: keep the
        # pipeline's shared memory under the H100's 227 KB.
        cfg["BLOCK_K"], cfg["num_stages"] = min(cfg["BLOCK_K"], 64), min(cfg["num_stages"], 3)
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(16, triton.next_power_of_2(k)))
    if blocked and kind == "gemv":  # whole scale columns per K step
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], scale_bk)
    elif blocked:  # one scale column per K step
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], scale_bk)
    stride_sn = scale.stride(0) if blocked else 0
    bias_arg = bias if bias is not None else scale  # never read without HAS_BIAS
    common = {"HAS_BIAS": bias is not None, "BLOCK_SCALES": blocked, "SCALE_BN": scale_bn, "SCALE_BK": scale_bk,
              "EVEN_K": k % cfg["BLOCK_K"] == 0}
    if kind == "gemv":
        grid = (m, triton.cdiv(n, cfg["BLOCK_N"]))
        _w8a16_gemv_kernel[grid](x, weight, scale, bias_arg, y, n, k,
                                 x.stride(0), weight.stride(0), stride_sn, y.stride(0), **common, **cfg)
    else:
        cfg.setdefault("GROUP_M", 8)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _w8a16_gemm_kernel[grid](x, weight, scale, bias_arg, y, m, n, k,
                                 x.stride(0), weight.stride(0), stride_sn, y.stride(0),
                                 IEEE_DOT=x.dtype == torch.float32 or _INTERPRETED, **common, **cfg)
    return y
