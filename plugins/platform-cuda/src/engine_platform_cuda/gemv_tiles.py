"""The skinny GEMM's tile steps (``gemv.py``'s kernels call them): storing a program's sums, a
weight tile, an activation tile with the RMSNorm applied as ``kernels.rms_norm`` rounds it, and the
norm's ``1 / rms`` of each row (summed in tiles, or in ``rms_norm``'s own order for a bit-equal
result). Kept apart so ``gemv.py`` holds the launch rules and the kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_tile(acc, offs_m, offs_n, pid_k, b_ptr, y_ptr, part_ptr, M, N, stride_ym,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ROUND: tl.constexpr):
    """``acc`` ``[rows, block_n]`` float32: a slice's partial sums, or the output (+ bias); with
    ``ROUND`` (a dtype; None: y's) the output is rounded to it before it is stored in y's dtype
    (float32 logits with the values of a 16-bit output widened)."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT:
        ptrs = part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + b[None, :]
        if ROUND is not None:
            acc = acc.to(ROUND).to(tl.float32)
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
        _store_norm_rows(x_row, r_row, nw_ptr, normed_ptr, res_ptr, out_row, row_mask, cols, rstd, K, HAS_RES,
                         False, ROW_BLOCK)
    return rstd


@triton.jit
def _store_norm_rows(x_row, r_row, nw_ptr, normed_ptr, res_ptr, out_row, row_mask, cols, rstd,
                     K: tl.constexpr, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr, ROW_BLOCK: tl.constexpr):
    """Stores the norm output ``w * (x (+ r)) * rstd`` of the rows (rounded as ``rms_norm`` rounds)
    and, with ``STORE_RES``, their ``x + r``; ``x_row``, ``r_row``, ``out_row``: ``[rows, ROW_BLOCK]``
    addresses (offsets) of each row's first tile, ``cols`` its columns."""
    for c in range(0, K, ROW_BLOCK):
        mask = row_mask & ((cols[None, :] + c) < K)
        x = tl.load(x_row + c, mask=mask, other=0.0)
        if HAS_RES:  # added again, not read back: other threads of the program stored the sum
            r = tl.load(r_row + c, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            if STORE_RES:
                tl.store(res_ptr + out_row + c, x, mask=mask)
        h = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        nw = tl.load(nw_ptr + cols + c, mask=(cols + c) < K, other=0.0)
        tl.store(normed_ptr + out_row + c, (nw.to(tl.float32)[None, :] * h.to(tl.float32)).to(x.dtype),
                 mask=mask)


@triton.jit
def _rms_tree_sum(x_ptr, r_ptr, M, stride_xm, stride_rm, K: tl.constexpr, HAS_RES: tl.constexpr,
                  BLOCK_M: tl.constexpr, TREE_W: tl.constexpr, TREE_V: tl.constexpr, TREE_STEPS: tl.constexpr):
    """The sum of squares of each row of ``x (+ residual)`` (``[BLOCK_M]`` float32) added in the
    order of ``kernels.rms_norm`` compiled, ``(TREE_W, TREE_V, TREE_STEPS)`` =
    ``kernels.rms_norm_sum_order(K)``: bit-equal to its sum, whatever layout this kernel's values
    get. Each of that kernel's ``TREE_W * 32`` threads' values is loaded on its own and added in
    that thread's order; the butterflies are written as sums over axes of two (one add, which
    either operand order gives the same)."""
    THREADS: tl.constexpr = TREE_W * 32
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows[:, None] < M
    # Column of each (row, thread)'s first slot.
    first_col = tl.arange(0, THREADS)[None, :] * TREE_V
    x_row = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    r_row = r_ptr + rows[:, None].to(tl.int64) * stride_rm
    acc = tl.zeros([BLOCK_M, THREADS], dtype=tl.float32)
    for step in tl.static_range(TREE_STEPS):
        col = first_col + ((step // TREE_V) * THREADS * TREE_V + step % TREE_V)
        mask = row_mask & (col < K)
        x = tl.load(x_row + col, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_row + col, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        xf = x.to(tl.float32)
        acc += xf * xf  # a 16-bit value's square is exact in float32: fused or not, the same sum
    # The lanes of each warp (thread = warp * 32 + lane), then the warps: pairs of the top bit first.
    acc = tl.reshape(acc, [BLOCK_M, TREE_W, 32])
    for level in tl.static_range(5):
        acc = tl.sum(tl.reshape(acc, [BLOCK_M, TREE_W, 2, 16 >> level]), axis=2)
    acc = tl.reshape(acc, [BLOCK_M, TREE_W])
    for level in tl.static_range(4):
        if (TREE_W >> level) > 1:
            acc = tl.sum(tl.reshape(acc, [BLOCK_M, 2, TREE_W >> (level + 1)]), axis=1)
    return tl.reshape(acc, [BLOCK_M])


@triton.jit
def _norm_rstd_exact(x_ptr, r_ptr, nw_ptr, normed_ptr, res_ptr, M, stride_xm, stride_rm, eps, first,
                     K: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, ROW_BLOCK: tl.constexpr,
                     TREE_W: tl.constexpr, TREE_V: tl.constexpr, TREE_STEPS: tl.constexpr):
    """``_norm_rstd`` with the sum of squares added in ``rms_norm``'s order (``_rms_tree_sum``):
    ``1 / rms`` and, where ``first``, the stored rows bit-equal to ``kernels.rms_norm``'s."""
    total = _rms_tree_sum(x_ptr, r_ptr, M, stride_xm, stride_rm, K, HAS_RES, BLOCK_M, TREE_W, TREE_V, TREE_STEPS)
    rstd = tl.rsqrt(total / K + eps)
    if first:
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, ROW_BLOCK)
        _store_norm_rows(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :],
                         r_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], nw_ptr, normed_ptr,
                         res_ptr, rows[:, None].to(tl.int64) * K + cols[None, :], rows[:, None] < M, cols, rstd, K,
                         HAS_RES, HAS_RES, ROW_BLOCK)
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
