"""LoRA kernels for decode batches of 16 or more one-token segments (see ``kernels`` for the rest).

- ``_shrink_slots_kernel`` (option ``slot_shrink``): a program per (adapter slot, row tile of A,
  K chunk) reads its tile of A once and multiplies it by every token of the batch on that slot;
  it stores float32 partial sums ``p[chunk, token, row]`` (one writer per entry, no atomics) that
  the expands add up.
- ``_expand_dense_kernel`` (option ``dense_expand``): a program per column tile of one slice takes
  every token, loads (or adds up) their y once, and sums each pool slot's B tile times y with the
  other slots' tokens zeroed; one read-modify-write of out at the end.
- ``_expand_slots_kernel`` (the default expand): a program per (slot, group of column tiles) over
  the slot's tokens.

Same conventions as ``kernels``: CUDA-graph safe grids from host sizes, no host sync, rows of
tokens outside every segment never read or written, PDL wait before reading activations.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_lora_triton.kernels import _product, _slice_of, _tile_columns


@triton.jit
def _segment_block(s0, num_segments, seg_indptr_ptr, weight_indices_ptr, BLOCK_S: tl.constexpr):
    """Segments ``[s0, s0 + BLOCK_S)`` of the batch: which exist, their slots (-1 past the last
    segment), and their first and end tokens (a decode batch's segments hold at most one)."""
    segs = s0 + tl.arange(0, BLOCK_S)
    s_ok = segs < num_segments
    owner = tl.load(weight_indices_ptr + segs, mask=s_ok, other=-1)
    tok = tl.load(seg_indptr_ptr + segs, mask=s_ok, other=0)
    end = tl.load(seg_indptr_ptr + segs + 1, mask=s_ok, other=0)
    return s_ok, owner, tok, end


@triton.jit
def _gather_y(y_ptr, rows, y_col0, offs_r, y_mask, stride_ys, stride_yt, stride_yr, SPLITS: tl.constexpr):
    """The tokens' ``rows`` of y from column ``y_col0`` (zero where ``y_mask`` is off), in float32:
    y itself, or the per-slot shrink's ``SPLITS`` float32 partial sums of it added up."""
    y_ptrs = y_ptr + rows[:, None] * stride_yt + (y_col0 + offs_r[None, :]) * stride_yr
    ysum = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    for sp in range(1, SPLITS):
        ysum += tl.load(y_ptrs + sp * stride_ys, mask=y_mask, other=0.0)
    return ysum


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
    # Groups never straddle slices (``_slice_of``, with groups for tiles).
    group = tl.program_id(1)
    lo, hi, first, y_col0 = _slice_of(group, groups0, groups01, off0, off1, off2, off3, R)
    col0 = lo + (group - first) * (TILES * BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + (col0 + offs_n[:, None]).to(tl.int64) * stride_bn \
        + offs_r[None, :] * stride_br
    scale = tl.load(scalings_ptr + slot)
    for s0 in tl.static_range(0, SEGS, BLOCK_S):
        s_ok, owner, tok, end = _segment_block(s0, num_segments, seg_indptr_ptr, weight_indices_ptr, BLOCK_S)
        mine = s_ok & (owner == slot) & (end > tok)
        if PDL and s0 == 0:
            # The batch info, B and the scalings were written before the forward; y and out are
            # the previous kernels'.
            tl.extra.cuda.gdc_wait()
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            rows = tok.to(tl.int64)
            # (rounded to B's dtype as a finished y would be)
            yv = _gather_y(y_ptr, rows, y_col0, offs_r, mine[:, None] & r_ok[None, :], stride_ys, stride_yt,
                           stride_yr, SPLITS).to(b_ptr.dtype.element_ty)
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
        s_ok, owner, tok, end = _segment_block(s0, num_segments, seg_indptr_ptr, weight_indices_ptr, BLOCK_S)
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
    cols, n_ok, y_col0 = _tile_columns(tl.program_id(0), tiles0, tiles01, off0, off1, off2, off3, R, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    for s0 in tl.static_range(0, SEGS, BLOCK_S):
        s_ok, owner, tok, end = _segment_block(s0, num_segments, seg_indptr_ptr, weight_indices_ptr, BLOCK_S)
        # A token on a rank-0 slot (the base model) keeps its row of out as it is.
        live = s_ok & (end > tok) & (tl.load(ranks_ptr + owner, mask=s_ok, other=0) > 0)
        if PDL and s0 == 0:
            # The batch info, B and the scalings were written before the forward; y and out are
            # the previous kernels'.
            tl.extra.cuda.gdc_wait()
        if tl.sum(live.to(tl.int32), axis=0) > 0:
            rows = tok.to(tl.int64)
            yv = _gather_y(y_ptr, rows, y_col0, offs_r, live[:, None] & (offs_r < R)[None, :], stride_ys, stride_yt,
                           stride_yr, SPLITS).to(b_ptr.dtype.element_ty)
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
