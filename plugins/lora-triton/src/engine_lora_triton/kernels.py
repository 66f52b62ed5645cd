"""Segmented LoRA shrink and expand (SGMV) in Triton.

The tokens of one forward are split into segments, contiguous runs that share one adapter slot
(``seg_indptr``, ``weight_indices``). Each program owns one token tile of one segment and one
tile of the output columns, so every program multiplies by a single adapter's matrix:

- shrink: ``y[t, :] = x[t, :] @ A[w].T`` over ``K`` (the layer's input), ``A[w]`` being
  ``[n_slices * R, K]``; rows of a rank-0 slot are written as zeros.
- expand: ``out[t, off_i:off_i+1] += scaling[w] * y[t, i*R:(i+1)*R] @ B[w, off_i:off_i+1].T``
  for each slice ``i`` (q/k/v of a fused QKV, gate/up); a rank-0 slot's rows are not touched.

Two forms of the same kernels, chosen per call from host-side sizes:

- ``DOT`` (prefill, segments of several tokens): token tiles of 16-64 rows, ``tl.dot``.
- token-parallel (``BLOCK_T == 1``, every segment one token: decode with one segment per
  request): a program is one token's matrix-vector product, a broadcast multiply and a sum in
  float32, with narrow output tiles so that a small batch still spreads over the SMs.
- per-slot expand (``_expand_slots_kernel``, decode batches of 16+ segments): a program per
  (adapter slot, group of column tiles) reads its B tiles once and applies them to the batch's
  tokens on that slot; the per-slot shrink (``_shrink_slots_kernel``) likewise reads each tile of
  A once, and leaves float32 partial sums over K chunks that the expand adds up.

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
    # Column tiles never straddle slices: tiles [0, tiles0) cover slice 0, [tiles0, tiles01) slice 1,
    # the rest slice 2 (the host passes the tile count as both bounds when there are fewer slices);
    # each tile reads its own slice's R columns of y.
    tile = tl.program_id(2)
    in1 = tile >= tiles0
    in2 = tile >= tiles01
    lo = tl.where(in2, off2, tl.where(in1, off1, off0))
    hi = tl.where(in2, off3, tl.where(in1, off2, off1))
    first = tl.where(in2, tiles01, tl.where(in1, tiles0, 0))
    y_col0 = (in1.to(tl.int32) + in2.to(tl.int32)) * R
    cols = lo + (tile - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < hi
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


@triton.jit
def _expand_slots_kernel(y_ptr, b_ptr, out_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, scalings_ptr,
                         num_segments, off0, off1, off2, off3, groups0, groups01,
                         stride_ys, stride_yt, stride_yr, stride_bs, stride_bn, stride_br, stride_ot, stride_on,
                         R: tl.constexpr, SEGS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_R: tl.constexpr, TILES: tl.constexpr, SPLITS: tl.constexpr, WIDEN: tl.constexpr,
                         IEEE: tl.constexpr, PDL: tl.constexpr):
    # Decode batches (segments of at most one token): one program per (slot, group of TILES column
    # tiles of one slice) gathers the batch's tokens on that slot and their y once, then applies
    # each of its B tiles to them: every adapter's B is read once, not once per token, and y (or
    # the per-slot shrink's partial sums) once per group, not once per tile.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.program_id(0)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    # Groups never straddle slices: groups [0, groups0) cover slice 0, [groups0, groups01) slice 1,
    # the rest slice 2 (the host passes the group count as both bounds when there are fewer slices).
    group = tl.program_id(1)
    in1 = group >= groups0
    in2 = group >= groups01
    lo = tl.where(in2, off2, tl.where(in1, off1, off0))
    hi = tl.where(in2, off3, tl.where(in1, off2, off1))
    first = tl.where(in2, groups01, tl.where(in1, groups0, 0))
    y_col0 = (in1.to(tl.int32) + in2.to(tl.int32)) * R
    col0 = lo + (group - first) * (TILES * BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + (col0 + offs_n[:, None]).to(tl.int64) * stride_bn \
        + offs_r[None, :] * stride_br
    scale = tl.load(scalings_ptr + slot)
    for s0 in tl.static_range(0, SEGS, BLOCK_S):
        segs = s0 + tl.arange(0, BLOCK_S)
        s_ok = segs < num_segments
        owner = tl.load(weight_indices_ptr + segs, mask=s_ok, other=-1)
        tok = tl.load(seg_indptr_ptr + segs, mask=s_ok, other=0)
        end = tl.load(seg_indptr_ptr + segs + 1, mask=s_ok, other=0)
        mine = s_ok & (owner == slot) & (end > tok)
        if PDL and s0 == 0:
            # The batch info, B and the scalings were written before the forward; y and out are
            # the previous kernels'.
            tl.extra.cuda.gdc_wait()
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            rows = tok.to(tl.int64)
            # y, or the per-slot shrink's SPLITS float32 partial sums of it (added here, rounded
            # to B's dtype as a finished y would be).
            y_ptrs = y_ptr + rows[:, None] * stride_yt + (y_col0 + offs_r[None, :]) * stride_yr
            y_mask = mine[:, None] & r_ok[None, :]
            ysum = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
            for sp in range(1, SPLITS):
                ysum += tl.load(y_ptrs + sp * stride_ys, mask=y_mask, other=0.0)
            yv = ysum.to(b_ptr.dtype.element_ty)
            out_ptrs = out_ptr + rows[:, None] * stride_ot + (col0 + offs_n[None, :]) * stride_on
            for t in range(TILES):
                n_ok = col0 + t * BLOCK_N + offs_n < hi
                bv = tl.load(b_ptrs + t * BLOCK_N * stride_bn, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
                acc = _product(yv, bv, True, WIDEN, IEEE)
                mask = mine[:, None] & n_ok[None, :]
                cur = tl.load(out_ptrs + t * BLOCK_N * stride_on, mask=mask, other=0.0)
                tl.store(out_ptrs + t * BLOCK_N * stride_on, (cur.to(tl.float32) + scale * acc).to(out_ptr.dtype.element_ty),
                         mask=mask)


@triton.jit
def _shrink_slots_kernel(x_ptr, a_ptr, p_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, num_segments,
                         stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ps, stride_pt, stride_pr,
                         ROWS: tl.constexpr, K: tl.constexpr, K_CHUNK: tl.constexpr, SEGS: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                         WIDEN: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    # Decode batches (segments of at most one token): one program per (slot, row tile, K chunk)
    # reads its tile of A once and multiplies it, with tl.dot, by every token of the batch on that
    # slot; it stores float32 partial sums p[chunk, token, row], which the per-slot expand adds up
    # (no atomics: each (chunk, token, row) has one writer).
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.program_id(0)
    if tl.load(ranks_ptr + slot) == 0:  # the base model or an empty slot: the expand skips its tokens
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < ROWS
    chunk = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar \
        + (chunk * K_CHUNK + offs_k[None, :]).to(tl.int64) * stride_ak
    for s0 in tl.static_range(0, SEGS, BLOCK_S):
        segs = s0 + tl.arange(0, BLOCK_S)
        s_ok = segs < num_segments
        owner = tl.load(weight_indices_ptr + segs, mask=s_ok, other=-1)
        tok = tl.load(seg_indptr_ptr + segs, mask=s_ok, other=0)
        end = tl.load(seg_indptr_ptr + segs + 1, mask=s_ok, other=0)
        mine = s_ok & (owner == slot) & (end > tok)
        if PDL and s0 == 0:
            # The batch info and A were written before the forward; x is the previous kernel's.
            tl.extra.cuda.gdc_wait()
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            rows = tok.to(tl.int64)
            x_ptrs = x_ptr + rows[:, None] * stride_xt + (chunk * K_CHUNK + offs_k[None, :]).to(tl.int64) * stride_xk
            acc = tl.zeros((BLOCK_S, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, K_CHUNK, BLOCK_K):
                k_ok = offs_k < K - chunk * K_CHUNK - k0
                xv = tl.load(x_ptrs + k0 * stride_xk, mask=mine[:, None] & k_ok[None, :], other=0.0)
                av = tl.load(a_ptrs + k0 * stride_ak, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                acc += _product(xv, av, True, WIDEN, IEEE)
            p_ptrs = p_ptr + chunk.to(tl.int64) * stride_ps + rows[:, None] * stride_pt + offs_r[None, :] * stride_pr
            tl.store(p_ptrs, acc, mask=mine[:, None] & r_ok[None, :])


@triton.jit
def _dense_slot_term(acc, yv, owner, b_ptr, ranks_ptr, scalings_ptr, s, cols, n_ok, offs_r,
                     stride_bs, stride_bn, stride_br, WIDEN: tl.constexpr, IEEE: tl.constexpr):
    """``acc`` plus slot ``s``'s share: its tokens' rows of y (others zero) times its B tile."""
    rank = tl.load(ranks_ptr + s)
    scale = tl.load(scalings_ptr + s)
    b_ptrs = b_ptr + s.to(tl.int64) * stride_bs + cols[:, None].to(tl.int64) * stride_bn + offs_r[None, :] * stride_br
    bv = tl.load(b_ptrs, mask=n_ok[:, None] & (offs_r < rank)[None, :], other=0.0)
    ym = tl.where((owner == s)[:, None], yv, tl.zeros_like(yv))
    return acc + scale * _product(ym, bv, True, WIDEN, IEEE)


@triton.jit
def _expand_dense_kernel(y_ptr, b_ptr, out_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, scalings_ptr,
                         num_segments, off0, off1, off2, off3, tiles0, tiles01,
                         stride_ys, stride_yt, stride_yr, stride_bs, stride_bn, stride_br, stride_ot, stride_on,
                         R: tl.constexpr, NUM_SLOTS: tl.constexpr, SEGS: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr, WIDEN: tl.constexpr,
                         IEEE: tl.constexpr, PDL: tl.constexpr):
    # Decode batches (segments of at most one token): one program per column tile (of one slice)
    # takes every token of the batch, loads their y once, and adds up every slot's product, each
    # slot's B tile times y with other slots' tokens zeroed; one read-modify-write of out at the
    # end. No store precedes a load, so the slots' B loads all go out together.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    in1 = tile >= tiles0
    in2 = tile >= tiles01
    lo = tl.where(in2, off2, tl.where(in1, off1, off0))
    hi = tl.where(in2, off3, tl.where(in1, off2, off1))
    first = tl.where(in2, tiles01, tl.where(in1, tiles0, 0))
    y_col0 = (in1.to(tl.int32) + in2.to(tl.int32)) * R
    cols = lo + (tile - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < hi
    offs_r = tl.arange(0, BLOCK_R)
    for s0 in tl.static_range(0, SEGS, BLOCK_S):
        segs = s0 + tl.arange(0, BLOCK_S)
        s_ok = segs < num_segments
        owner = tl.load(weight_indices_ptr + segs, mask=s_ok, other=0)
        tok = tl.load(seg_indptr_ptr + segs, mask=s_ok, other=0)
        end = tl.load(seg_indptr_ptr + segs + 1, mask=s_ok, other=0)
        # A token on a rank-0 slot (the base model) keeps its row of out as it is.
        live = s_ok & (end > tok) & (tl.load(ranks_ptr + owner, mask=s_ok, other=0) > 0)
        if PDL and s0 == 0:
            # The batch info, B and the scalings were written before the forward; y and out are
            # the previous kernels'.
            tl.extra.cuda.gdc_wait()
        if tl.sum(live.to(tl.int32), axis=0) > 0:
            rows = tok.to(tl.int64)
            y_ptrs = y_ptr + rows[:, None] * stride_yt + (y_col0 + offs_r[None, :]) * stride_yr
            y_mask = live[:, None] & (offs_r < R)[None, :]
            ysum = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
            for sp in range(1, SPLITS):  # the per-slot shrink's partial sums over K chunks
                ysum += tl.load(y_ptrs + sp * stride_ys, mask=y_mask, other=0.0)
            yv = ysum.to(b_ptr.dtype.element_ty)
            acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
            if NUM_SLOTS <= 32:
                for s in tl.static_range(NUM_SLOTS):
                    acc = _dense_slot_term(acc, yv, owner, b_ptr, ranks_ptr, scalings_ptr, tl.full((), s, tl.int32),
                                           cols, n_ok, offs_r, stride_bs, stride_bn, stride_br, WIDEN, IEEE)
            else:
                for s in range(NUM_SLOTS):  # (the interpreter's s is a Python int)
                    acc = _dense_slot_term(acc, yv, owner, b_ptr, ranks_ptr, scalings_ptr, tl.zeros((), tl.int32) + s,
                                           cols, n_ok, offs_r, stride_bs, stride_bn, stride_br, WIDEN, IEEE)
            mask = live[:, None] & n_ok[None, :]
            out_ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :] * stride_on
            cur = tl.load(out_ptrs, mask=mask, other=0.0)
            tl.store(out_ptrs, (cur.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)
