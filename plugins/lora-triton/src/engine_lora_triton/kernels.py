"""Segmented LoRA shrink and expand (SGMV) in Triton.

The tokens of one forward are split into segments, contiguous runs that share one adapter slot
(``seg_indptr``, ``weight_indices``). Each program owns one token tile of one segment and one
tile of the output columns, so every program multiplies by a single adapter's matrix:

- shrink: ``y[t, :] = x[t, :] @ A[w].T`` over ``K`` (the layer's input), ``A[w]`` being
  ``[n_slices * R, K]``; rows of a rank-0 slot are written as zeros.
- expand: ``out[t, off_i:off_i+1] += scaling[w] * y[t, i*R:(i+1)*R] @ B[w, off_i:off_i+1].T``
  for each slice ``i`` (q/k/v of a fused QKV, gate/up); a rank-0 slot's rows are not touched.

Two forms of the same kernels, chosen per call from host-side sizes:

- ``DOT`` (prefill, segments of several tokens): token tiles of 16-64 rows, ``tl.dot``; a
  short prefill's shrink may split K into chunks (``K_CHUNK``), each program storing float32
  partial sums that the expand adds up (``SPLITS``).
- token-parallel (``BLOCK_T == 1``, every segment one token: decode with one segment per
  request): a program is one token's matrix-vector product, a broadcast multiply and a sum in
  float32, with narrow output tiles so that a small batch still spreads over the SMs.
- decode batches of 16+ segments: the kernels in ``engine_lora_triton.slot_kernels``.

CUDA-graph safe: the grid comes from ``num_segments`` and ``max_seg_len`` (host ints, which may
be upper bounds: token tiles past a segment's end return at once) and the tensors' shapes; no
host sync; the only allocation is shrink's output, sized by ``x`` and ``A`` (its rows of tokens
outside every segment, the padding of a captured batch, are not written).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton 3.6's interpreter (CPU tests) computes 16-bit tl.dot wrongly: there the tiles are widened
# to float32 before the product.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _product(a, b, DOT: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr):
    """``a [M, C] @ b [N, C].T`` in float32."""
    if DOT:
        if WIDEN:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            return tl.dot(a, tl.trans(b), input_precision="ieee")
        return tl.dot(a, tl.trans(b))
    return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _slice_of(tile, tiles0, tiles01, off0, off1, off2, off3, R: tl.constexpr):
    """The slice that program ``tile`` of an expand's column axis falls in: its output columns
    ``[lo, hi)``, the slice's first tile, and its first column of y. Tiles never straddle slices:
    tiles [0, tiles0) cover slice 0, [tiles0, tiles01) slice 1, the rest slice 2 (the host passes
    the tile count as both bounds when there are fewer slices)."""
    in1 = tile >= tiles0
    in2 = tile >= tiles01
    lo = tl.where(in2, off2, tl.where(in1, off1, off0))
    hi = tl.where(in2, off3, tl.where(in1, off2, off1))
    first = tl.where(in2, tiles01, tl.where(in1, tiles0, 0))
    return lo, hi, first, (in1.to(tl.int32) + in2.to(tl.int32)) * R


@triton.jit
def _tile_columns(tile, tiles0, tiles01, off0, off1, off2, off3, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``tile`` of an expand whose programs each own ``BLOCK_N`` columns of one slice
    (``_slice_of``): its output columns, which of them are inside the slice, and the slice's first
    column of y."""
    lo, hi, first, y_col0 = _slice_of(tile, tiles0, tiles01, off0, off1, off2, off3, R)
    cols = lo + (tile - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    return cols, cols < hi, y_col0


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, y_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr,
                   stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ys, stride_yt, stride_yr,
                   ROWS: tl.constexpr, K: tl.constexpr, K_CHUNK: tl.constexpr, ROW_TILES: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    # Axis 2 numbers (K chunk, row tile) pairs. With one chunk (K_CHUNK >= K) y is the result;
    # with several (short prefills: few token tiles) each program stores its chunk's float32
    # partial sums at y + chunk * stride_ys, which the expand adds up.
    if PDL:
        # Before its wait a program reads only the batch info and A (written before the forward),
        # and writes nothing: the previous kernel may still be running.
        tl.extra.cuda.gdc_launch_dependents()
    seg = tl.program_id(0)
    start = tl.load(seg_indptr_ptr + seg)
    end = tl.load(seg_indptr_ptr + seg + 1)
    t0 = start + tl.program_id(1) * BLOCK_T
    if t0 >= end:  # past this segment's end (max_seg_len is an upper bound), or an empty segment
        return
    slot = tl.load(weight_indices_ptr + seg)
    live = tl.load(ranks_ptr + slot) > 0  # a rank-0 slot (base model) keeps zeros, reads nothing
    chunk = tl.program_id(2) // ROW_TILES
    k_left = K - chunk * K_CHUNK  # this chunk's columns of x and A start at chunk * K_CHUNK
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_r = (tl.program_id(2) % ROW_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < end
    r_ok = (offs_r < ROWS) & live
    x_ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + (chunk * K_CHUNK + offs_k[None, :]) * stride_xk
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar \
        + (chunk * K_CHUNK + offs_k[None, :]) * stride_ak
    av = tl.load(a_ptrs, mask=r_ok[:, None] & (offs_k < k_left)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    xv = tl.load(x_ptrs, mask=(t_ok & live)[:, None] & (offs_k < k_left)[None, :], other=0.0)
    acc = _product(xv, av, DOT, WIDEN, IEEE)
    if live:
        for k0 in range(BLOCK_K, K_CHUNK, BLOCK_K):
            k_ok = offs_k < k_left - k0
            xv = tl.load(x_ptrs + k0 * stride_xk, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            av = tl.load(a_ptrs + k0 * stride_ak, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc += _product(xv, av, DOT, WIDEN, IEEE)
    y_ptrs = y_ptr + chunk.to(tl.int64) * stride_ys + offs_t[:, None].to(tl.int64) * stride_yt \
        + offs_r[None, :] * stride_yr
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & (offs_r < ROWS)[None, :])


@triton.jit
def _expand_kernel(y_ptr, b_ptr, out_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, scalings_ptr,
                   off0, off1, off2, off3, tiles0, tiles01,
                   stride_ys, stride_yt, stride_yr, stride_bs, stride_bn, stride_br, stride_ot, stride_on,
                   R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   SPLITS: tl.constexpr, DOT: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr,
                   PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    seg = tl.program_id(0)
    start = tl.load(seg_indptr_ptr + seg)
    end = tl.load(seg_indptr_ptr + seg + 1)
    t0 = start + tl.program_id(1) * BLOCK_T
    if t0 >= end:
        return
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:  # the base model: its rows of out stay as they are
        return
    # Each column tile reads its own slice's R columns of y.
    cols, n_ok, y_col0 = _tile_columns(tl.program_id(2), tiles0, tiles01, off0, off1, off2, off3, R, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None].to(tl.int64) * stride_bn + offs_r[None, :] * stride_br
    bv = tl.load(b_ptrs, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    scale = tl.load(scalings_ptr + slot)
    if PDL:
        tl.extra.cuda.gdc_wait()
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_ok = offs_t < end
    y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + (y_col0 + offs_r[None, :]) * stride_yr
    y_mask = t_ok[:, None] & r_ok[None, :]
    yv = tl.load(y_ptrs, mask=y_mask, other=0.0)
    if SPLITS > 1:  # the shrink's float32 partial sums over K chunks, rounded as a finished y
        ysum = yv.to(tl.float32)
        for sp in range(1, SPLITS):
            ysum += tl.load(y_ptrs + sp * stride_ys, mask=y_mask, other=0.0)
        yv = ysum.to(b_ptr.dtype.element_ty)
    acc = _product(yv, bv, DOT, WIDEN, IEEE)
    mask = t_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + cols[None, :] * stride_on
    cur = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (cur.to(tl.float32) + scale * acc).to(out_ptr.dtype.element_ty), mask=mask)
