"""Triton dequantize-GEMM for ``KernelWeight`` (see ``layout``): ``y = x @ W.T + bias``.

Two kernels, both with float32 accumulation and bf16/fp16 (or fp32) activations:

- ``_gemv_kernel`` (decode, M = 1): one program per ``BLOCK_N`` output channels and row,
  walking all of K. Small ``BLOCK_N`` (16 to 64) gives a Llama-8B linear 256 to 900 programs,
  two or more per SM of an H100 (132), so no split-K is needed and the sum is
  deterministic. Each weight word is loaded once. Per group, codes times activations are
  summed first and the scale and zero applied once:
  ``sum_k (q_k - z) s x_k = s (sum_k q_k x_k - z sum_k x_k)``, so the inner loop costs a
  shift, a mask, a convert and an FMA per weight.
- ``_gemm_kernel`` (M > 1): ``tl.dot`` tiles. A K tile never straddles a group; the tile
  of ``q - z`` (integers of at most 9 bits, exact in bf16/fp16) feeds the tensor cores and
  the group's scale multiplies the float32 partial product, so the weight is never rounded
  to the activation dtype.

``K`` is a compile-time constant in both (a model has two or three): the loop bounds are known
to the compiler, and Triton 3.6's interpreter cannot loop over a run-time bound under numpy 2.4.

Both are CUDA-graph safe: block sizes depend on shapes only (Python ints), no host syncs,
and the only allocation is the output.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine_quant_wna16.layout import KernelWeight

# Triton 3.6's interpreter (CPU tests) computes 16-bit tl.dot wrongly: there the tiles are widened
# to float32 first (on a GPU that is the float32-activation path: exact IEEE products).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

#: up to this many rows the GEMV kernel runs (one program row per activation row).
GEMV_MAX_M = 1


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr,
                 N, K: tl.constexpr, stride_xm, stride_om,
                 BITS: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr, NG: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # SUB = min(GROUP, BLOCK_K) rows per group slice, NG = BLOCK_K // SUB slices per K tile.
    PACK: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // PACK)
    shifts = tl.arange(0, PACK) * BITS
    offs_kk = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, NG)
    num_words = K // PACK
    num_groups = K // GROUP
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rows = k0 // PACK + offs_w
        w = tl.load(qw_ptr + rows[:, None] * N + offs_n[None, :],
                    mask=(rows[:, None] < num_words) & n_mask[None, :], other=0)
        q = (w[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
        q = tl.reshape(q, (NG, SUB, BLOCK_N)).to(tl.float32)
        offs_k = k0 + offs_kk
        k_mask = offs_k < K
        if HAS_PERM:
            src = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
        else:
            src = offs_k
        xv = tl.reshape(tl.load(x_row + src, mask=k_mask, other=0.0).to(tl.float32), (NG, SUB))
        part = tl.sum(q * xv[:, :, None], axis=1)
        x_sum = tl.sum(xv, axis=1)
        g = k0 // GROUP + offs_g
        g_mask = (g[:, None] < num_groups) & n_mask[None, :]
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=g_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=g_mask, other=0).to(tl.float32)
            acc += tl.sum(s * (part - z * x_sum[:, None]), axis=0)
        else:
            acc += tl.sum(s * (part - (1 << (BITS - 1)) * x_sum[:, None]), axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr,
                 M, N, K: tl.constexpr, stride_xm, stride_om,
                 BITS: tl.constexpr, GROUP: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOT_FP32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # BLOCK_K divides GROUP (and so K): a K tile lies inside one group, with no K mask.
    PACK: tl.constexpr = 32 // BITS
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    # Neighbouring programs share a weight tile (same pid_n), so it is read from DRAM once.
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // PACK)
    shifts = tl.arange(0, PACK) * BITS
    offs_kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kk
        if HAS_PERM:
            src = tl.load(perm_ptr + offs_k)
        else:
            src = offs_k
        a = tl.load(x_rows + src[None, :], mask=m_mask[:, None], other=0.0)
        rows = k0 // PACK + offs_w
        w = tl.load(qw_ptr + rows[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
        q = tl.reshape((w[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1), (BLOCK_K, BLOCK_N))
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.int32)
            b = (q - z[None, :]).to(a.dtype)
        else:
            b = (q - (1 << (BITS - 1))).to(a.dtype)
        if DOT_FP32:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        acc += part * s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class KernelConfig:
    """Which kernel runs and its tile sizes (``block_m`` is unused by the GEMV kernel)."""

    kind: str  # "gemv" or "gemm"
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs: pretend an H100, so CPU tests take the GPU's choices
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def fit_block_k(group_size: int, block_k: int, inside_group: bool) -> int:
    """The largest power of two ``<= block_k`` that tiles groups: it divides ``group_size`` (or,
    unless ``inside_group``, is a multiple of it)."""
    bk = block_k
    while bk > 16 and group_size % bk and (inside_group or bk % group_size):
        bk //= 2
    return bk


def _widest_block_n(candidates: tuple[int, ...], n: int, programs_per_n: int, want: int) -> int:
    for bn in candidates:
        if triton.cdiv(n, bn) * programs_per_n >= want:
            return bn
    return candidates[-1]


def choose_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> KernelConfig:
    """Tile sizes for an ``[m, k] x [k, n]`` product (heuristics; ``bench_kernels.py --sweep``
    measures the alternatives)."""
    sms = _num_sms(device)
    if m <= GEMV_MAX_M:
        # About 8K weights per program and iteration: 4 KB of int4 words, 64 per thread.
        bn = _widest_block_n((64, 32, 16), n, m, 2 * sms)
        bk = fit_block_k(group_size, 8192 // bn, inside_group=False)
        return KernelConfig("gemv", 1, bn, bk, 4, 3)
    if m <= 16:
        bn = _widest_block_n((64, 32, 16), n, 1, 2 * sms)
        return KernelConfig("gemm", 16, bn, fit_block_k(group_size, 128, True), 4, 4)
    if m <= 64:
        bm = 32 if m <= 32 else 64
        bn = _widest_block_n((128, 64, 32), n, triton.cdiv(m, bm), sms)
        return KernelConfig("gemm", bm, bn, fit_block_k(group_size, 64, True), 4, 4)
    bm = 64 if m <= 128 else 128
    bn = _widest_block_n((128, 64), n, triton.cdiv(m, bm), sms)
    warps = 8 if bm * bn >= 128 * 128 else 4
    return KernelConfig("gemm", bm, bn, fit_block_k(group_size, 64, True), warps, 3)


def wna16_gemm(x: torch.Tensor, kw: KernelWeight, bias: torch.Tensor | None = None,
               config: KernelConfig | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with the Triton kernels (CUDA, or Triton's interpreter on the CPU).

    Args:
        x: ``[..., K]`` activations, float16, bfloat16 or float32.
        kw: the layer's packed weight.
        bias: optional ``[N]``.
        config: tile sizes; default ``choose_config``.
    """
    k, n = kw.in_features, kw.out_features
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    cfg = config or choose_config(m, n, k, kw.group_size, x.device)
    # Absent operands get a placeholder pointer; their constexpr flag keeps it unread.
    zeros = kw.zeros if kw.zeros is not None else kw.qweight
    perm = kw.perm if kw.perm is not None else kw.qweight
    bias_arg = bias if bias is not None else kw.qweight
    flags = dict(HAS_ZEROS=kw.zeros is not None, HAS_PERM=kw.perm is not None, HAS_BIAS=bias is not None)
    if cfg.kind == "gemv":
        sub = min(kw.group_size, cfg.block_k)
        grid = (triton.cdiv(n, cfg.block_n), m)
        _gemv_kernel[grid](x2d, kw.qweight, kw.scales, zeros, perm, bias_arg, out, n, K=k,
                           stride_xm=x2d.stride(0), stride_om=out.stride(0), BITS=kw.bits,
                           GROUP=kw.group_size, SUB=sub,
                           NG=cfg.block_k // sub, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
    else:
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        _gemm_kernel[grid](x2d, kw.qweight, kw.scales, zeros, perm, bias_arg, out, m, n, K=k,
                           stride_xm=x2d.stride(0), stride_om=out.stride(0), BITS=kw.bits, GROUP=kw.group_size,
                           DOT_FP32=x.dtype == torch.float32 or _INTERPRETED, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                           BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
    return out.reshape(*x.shape[:-1], n)
