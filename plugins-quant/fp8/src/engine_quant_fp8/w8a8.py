"""Triton fp8 x fp8 GEMM (activations quantized too) for large M, and per-token-group quantization.

``w8a8_linear``: ``y = (qx * sx) @ (qw * sw).T (+ bias)`` on the fp8 tensor cores, float32
accumulation, output in the activation dtype. Both tiles go to the tensor cores as stored (the
weight ``[N, K]`` row-major is the K-major operand fp8 wgmma wants). Scales:

- per channel: ``sx [M, 1]`` per token (``kernels.quantize_per_token_triton``) and ``sw [N]``,
  applied once to the accumulator;
- per block (DeepSeek-V3): ``sx [M, ceil(K/g)]`` per token and ``g``-wide K group
  (``quantize_per_token_group``, ``g`` = the weight block's K size) and ``sw [ceil(N/bn), ceil(K/bk)]``,
  applied per K step (BLOCK_K never spans two groups).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from engine_quant_fp8.kernels import _INTERPRETED, _gemm_tile, quantize_per_token_triton
from engine_quant_fp8.quantize import _MIN_SCALE, FP8_DTYPE, FP8_MAX


@triton.jit
def _quantize_per_token_group_kernel(x_ptr, q_ptr, s_ptr, K: tl.constexpr, stride_xm, stride_qm, stride_sm,
                                     GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                                     QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    v = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), axis=1) / QMAX, MIN_SCALE)
    q = tl.clamp(tl.math.div_rn(v, scale[:, None]), -QMAX, QMAX)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + groups, scale, mask=groups * GROUP < K)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K] e4m3fn, scale [M, ceil(K/group)] float32)``: one dynamic scale per token and
    ``group`` consecutive columns (a power of two)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    per_prog = min(triton.next_power_of_2(groups), max(1, 2048 // group))
    _quantize_per_token_group_kernel[(m, triton.cdiv(groups, per_prog))](
        x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), GROUP=group, GROUPS_PER_PROG=per_prog,
        QMAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, num_warps=4)
    return q, scale


def quantize_per_token_group_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch-op version of ``quantize_per_token_group`` (test oracle)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    scale = (padded.reshape(m, groups, group).abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    full = scale.repeat_interleave(group, dim=1)[:, :k]
    return (x.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@triton.jit
def _w8a8_gemm_kernel(x_ptr, w_ptr, sx_ptr, sw_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr,
                      stride_xm, stride_wn, stride_sxm, stride_swn, stride_ym,
                      HAS_BIAS: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                      SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                      SPLIT_K: tl.constexpr = 1):
    offs_m, offs_n, mask_m, mask_n, rows_x, rows_w = _gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # Split-K (per-channel scales only): program k of SPLIT_K sums its K / SPLIT_K slice and
    # stores the raw float32 partial in y[k]; _split_k_reduce_kernel sums, scales and casts.
    K_PART: tl.constexpr = K // SPLIT_K
    k_start = tl.program_id(1) * K_PART
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rows_w[None, :] * stride_wn + (k_start + offs_k)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_PART, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            mask_k = k0 + offs_k < K
            x = tl.load(x_ptrs, mask=mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None], other=0.0)
        if UPCAST:  # Triton's interpreter: its fp8 tl.dot is not reliable; float32 is exact here
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w)
        if BLOCK_SCALES:
            sx = tl.load(sx_ptr + rows_x * stride_sxm + k0 // SCALE_BK)
            sw = tl.load(sw_ptr + (rows_w // SCALE_BN) * stride_swn + k0 // SCALE_BK)
            acc += part * sx[:, None] * sw[None, :]
        else:
            acc += part
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT_K > 1:
        y_ptrs = y_ptr + (tl.program_id(1) * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(y_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])
        return
    if not BLOCK_SCALES:
        acc = acc * tl.load(sx_ptr + rows_x * stride_sxm)[:, None] * tl.load(sw_ptr + rows_w)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _split_k_reduce_kernel(p_ptr, sx_ptr, sw_ptr, b_ptr, y_ptr, M, N, stride_sxm, stride_ym,
                           HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(SPLIT_K):
        acc += tl.load(p_ptr + (k * M + row) * N + cols, mask=mask, other=0.0)
    acc = acc * tl.load(sx_ptr + row * stride_sxm) * tl.load(sw_ptr + cols, mask=mask, other=1.0)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _w8a8_config(m: int, n: int, k: int, blocked: bool) -> dict[str, int]:
    # H100 sweeps (benchmarks/bench_kernels.py --sweep-w8a8 and benchmarks/bench_fused.py --sweep).
    # 64-row tiles throughout: 128-row ones never won below M = 1024. Per-channel, M 33-128:
    # split-K for the long-K, narrow-N down projection (4096 x 14336: 64 programs of 64 columns
    # leave half the SMs idle; split in 2-4 it fell from 34.9 to 29.3 us at M = 64), 128-wide
    # tiles up to M = 48 and 32-wide above for the 4096/6144-row ones, 64-128 for gate_up.
    if not blocked and 32 < m <= 128:
        if k >= 2 * n:  # down
            if m <= 48:
                return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
                        "num_stages": 5, "SPLIT_K": 4}
            return {"BLOCK_M": 64, "BLOCK_N": 32 if m <= 64 else 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
                    "num_stages": 5, "SPLIT_K": 2}
        if n >= 16384:  # gate_up
            bn, stages = (64, 5) if 48 < m <= 64 else (128, 4)
            return {"BLOCK_M": 64, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": stages}
        return {"BLOCK_M": 64, "BLOCK_N": 128 if m <= 48 else 32, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
                "num_stages": 5}
    if not blocked and m <= 32:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 5}
    if m <= 64 or (m <= 128 and n <= 8192):
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 5}
    if n <= 8192 and k > n:  # down: 256-wide tiles for large M
        return {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
            "num_stages": 3 if blocked else 4}


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                block_size: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
                config: dict[str, Any] | None = None) -> torch.Tensor:
    """Quantizes ``x [M, K]`` (per token, or per token and K group with ``block_size``; a static
    ``input_scale`` for per-channel weights) and multiplies on the fp8 tensor cores; ``x.dtype`` out."""
    if x.shape[0] == 0:
        return torch.empty((0, weight.shape[0]), dtype=x.dtype, device=x.device)
    if block_size is not None:
        qx, sx = quantize_per_token_group(x, block_size[1])
    else:
        qx, sx = quantize_per_token_triton(x, input_scale)
    return w8a8_gemm(qx, sx, weight, scale, bias, x.dtype, block_size, config)


def w8a8_gemm(qx: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype, block_size: tuple[int, int] | None = None,
              config: dict[str, Any] | None = None) -> torch.Tensor:
    """``(qx * sx) @ (weight * scale).T (+ bias)`` for activations already quantized (``qx [M, K]``
    e4m3fn with ``sx [M, 1]``, or ``[M, ceil(K/bk)]`` with ``block_size``); ``out_dtype`` out."""
    m, k = qx.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=qx.device)
    if m == 0:
        return y
    blocked = block_size is not None
    scale_bn, scale_bk = block_size if blocked else (1, 1)  # type: ignore[misc]
    cfg = dict(config) if config else _w8a8_config(m, n, k, blocked)
    if blocked:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], scale_bk)
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(32, triton.next_power_of_2(k)))
    split = cfg.pop("SPLIT_K", 1)
    if blocked or k % (split * cfg["BLOCK_K"]):
        split = 1  # each slice must be whole K steps; block scales are applied per step
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    # Split-K writes float32 partials [split, m, n]; the reduce applies scales and bias.
    out = torch.empty((split, m, n), dtype=torch.float32, device=qx.device) if split > 1 else y
    _w8a8_gemm_kernel[grid](qx, weight, sx, scale, bias if bias is not None else scale, out, m, n, k,
                            qx.stride(0), weight.stride(0), sx.stride(0), scale.stride(0) if blocked else 0,
                            y.stride(0), HAS_BIAS=bias is not None, BLOCK_SCALES=blocked,
                            SCALE_BN=scale_bn, SCALE_BK=scale_bk, EVEN_K=k % cfg["BLOCK_K"] == 0,
                            UPCAST=_INTERPRETED, SPLIT_K=split, **cfg)
    if split > 1:
        _split_k_reduce_kernel[(m, triton.cdiv(n, 1024))](out, sx, scale, bias if bias is not None else scale, y,
                                                          m, n, sx.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                                                          SPLIT_K=split, BLOCK_N=1024, num_warps=4)
    return y
