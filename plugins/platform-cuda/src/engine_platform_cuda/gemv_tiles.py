"""The skinny GEMM's tile steps (``gemv.py``'s kernels call them): storing a program's sums, a
weight tile, an activation tile with the RMSNorm applied as ``kernels.rms_norm`` rounds it, and the
norm's ``1 / rms`` of each row. Kept apart so ``gemv.py`` holds the launch rules and the kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_tile(acc, offs_m, offs_n, pid_k, b_ptr, y_ptr, part_ptr, M, N, stride_ym,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """``acc`` ``[rows, block_n]`` float32: a slice's partial sums, or the output (+ bias)."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT:
        ptrs = part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + b[None, :]
        ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rstd(x_ptr, r_ptr, nw_ptr, normed_ptr, res_ptr, M, stride_xm, stride_rm, eps, first,
               K: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, ROW_BLOCK: tl.constexpr):
    """``1 / rms`` of each row of ``x (+ residual)`` (``[BLOCK_M]`` float32), rounded as
    ``kernels._rmsnorm_kernel`` rounds; where ``first``, also stores the rows' sum and norm output."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, ROW_BLOCK)
    row_mask = rows[:, None] < M
    x_row = x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :]
    r_row = r_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :]
    out_row = rows[:, None].to(tl.int64) * K + cols[None, :]
    squares = tl.zeros([BLOCK_M, ROW_BLOCK], dtype=tl.float32)
    for c in range(0, K, ROW_BLOCK):
        mask = row_mask & ((cols[None, :] + c) < K)
        x = tl.load(x_row + c, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_row + c, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # PyTorch adds in the activation dtype
            tl.store(res_ptr + out_row + c, x, mask=mask & first)
        xf = x.to(tl.float32)
        squares += xf * xf
    rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)
    if first:
        # The norm output for readers after the consumer (the MoE experts): one program writes it.
        for c in range(0, K, ROW_BLOCK):
            mask = row_mask & ((cols[None, :] + c) < K)
            x = tl.load(x_row + c, mask=mask, other=0.0)
            if HAS_RES:  # added again, not read back: other threads of the program stored the sum
                r = tl.load(r_row + c, mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            h = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
            nw = tl.load(nw_ptr + cols + c, mask=(cols + c) < K, other=0.0)
            tl.store(normed_ptr + out_row + c, (nw.to(tl.float32)[None, :] * h.to(tl.float32)).to(x.dtype),
                     mask=mask)
    return rstd


@triton.jit
def _w_tile(w_ptrs, offset, k3, K: tl.constexpr, EVEN_K: tl.constexpr):
    """The weight tile ``offset`` columns past ``w_ptrs`` (``k3``: its columns' offsets in K, less
    ``offset``); columns past K read as zeros."""
    if EVEN_K:
        return tl.load(w_ptrs + offset)
    return tl.load(w_ptrs + offset, mask=(k3 + offset) < K, other=0.0)


@triton.jit
def _x_tile(x_ptrs, r_ptrs, nw_ptrs, kk, m_mask, k3, rstd, K: tl.constexpr, EVEN_K: tl.constexpr,
            NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """One K step of x (``kk`` past the slice's start, which ``x_ptrs`` has reached) as float32;
    with ``NORM`` the norm output ``w * (x (+ r)) * rstd`` rounded as ``_norm_rstd`` rounds it."""
    k_mask = (k3 + kk) < K  # unused (and dropped) with EVEN_K
    mask = m_mask if EVEN_K else m_mask & k_mask
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if NORM:
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(r_ptrs + kk, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        h = (x.to(tl.float32) * rstd).to(x.dtype)
        nw = tl.load(nw_ptrs + kk) if EVEN_K else tl.load(nw_ptrs + kk, mask=k_mask, other=0.0)
        x = (nw.to(tl.float32) * h.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)
