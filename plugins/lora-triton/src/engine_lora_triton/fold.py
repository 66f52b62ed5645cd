"""The expand of a folded shrink: the base layer's GEMM already computed every slot's ``x @ A^T``.

A LoRA layer over an unquantized weight may keep its slots' A matrices as extra output rows of
the weight, ``W' = [W; A_0; ...; A_{S-1}]`` (``engine.lora.layers``), so that one GEMM
``h = x @ W'^T`` gives the base output (columns ``[0, N)``) and every slot's shrink (slot ``w``'s
``n_slices * R`` columns from ``N + w * n_slices * R``). ``_expand_folded_kernel`` then writes
a contiguous ``out[t, :N] = h[t, :N] + scaling[w] * h[t, slot w's slice i] @ B[w, slice i]^T``,
``w`` the slot of t's segment: one launch instead of a shrink and an expand.

A program owns one column tile of one slice and one tile of tokens. It finds each token's slot
(a decode batch of one-token segments reads it directly, else from ``seg_indptr``), loads the
base columns and each token's own slot's columns of h once, and adds, for every slot, that
slot's B tile times its tokens' rows (``tl.dot``, the other tokens zeroed); the scaling is
applied per token at the end. Nothing branches between the loads, so they can all be in flight
together; a slot no token of the tile uses has its B tile masked off (never read). Tokens in no
segment (a graph's padding) or on rank-0 slots get the base columns alone. CUDA-graph safe: the
grid comes from the shapes and ``num_segments``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from engine_lora_triton.kernels import _INTERPRETED, _product, _tile_columns
from engine_lora_triton.launch import _cdiv, _segment_passes, _slice_bounds, _slice_plan, sm_count


@triton.jit
def _expand_folded_kernel(h_ptr, b_ptr, out_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, scalings_ptr,
                          num_tokens, num_segments, n_base, slot_cols, h_slots, off0, off1, off2, off3, tiles0,
                          tiles01, stride_ht, stride_hn, stride_bs, stride_bn, stride_br, stride_ot, stride_on,
                          R: tl.constexpr, NUM_SLOTS: tl.constexpr, ONE_TOKEN: tl.constexpr, SEGS: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_R: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    cols, n_ok, y_col0 = _tile_columns(tl.program_id(0), tiles0, tiles01, off0, off1, off2, off3, R, BLOCK_N)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = toks < num_tokens
    if ONE_TOKEN:
        # Every segment is one token (a decode batch): token t's slot is segment t's.
        owner = tl.load(weight_indices_ptr + toks, mask=toks < num_segments, other=-1)
    else:
        # A token's segment: the number of segments ending at or before it (empty ones included).
        seg = tl.zeros((BLOCK_T,), dtype=tl.int32)
        for s0 in tl.static_range(0, SEGS, BLOCK_S):
            segs = s0 + tl.arange(0, BLOCK_S)
            ends = tl.load(seg_indptr_ptr + 1 + segs, mask=segs < num_segments, other=2147483647)
            seg += tl.sum((ends[None, :] <= toks[:, None]).to(tl.int32), axis=1)
        owner = tl.load(weight_indices_ptr + seg, mask=t_ok & (seg < num_segments), other=-1)
    # (slots past h's columns have rank 0 by the caller's contract; masked all the same)
    owner = tl.where(t_ok & (owner < h_slots), owner, -1)
    has = owner >= 0
    # A rank-0 slot's scaling may be stale (an unloaded adapter's): its tokens get 0.
    scale = tl.where(tl.load(ranks_ptr + owner, mask=has, other=0) > 0,
                     tl.load(scalings_ptr + owner, mask=has, other=0.0), 0.0)
    offs_r = tl.arange(0, BLOCK_R)
    if PDL:
        # The batch info, B and the scalings were written before the forward; h is the GEMM's.
        tl.extra.cuda.gdc_wait()
    rows = toks.to(tl.int64) * stride_ht
    mask = t_ok[:, None] & n_ok[None, :]
    base = tl.load(h_ptr + rows[:, None] + cols[None, :].to(tl.int64) * stride_hn, mask=mask, other=0.0)
    # Each token's own slot's columns of h, loaded once; then, for every slot, its B tile times the
    # rows of its tokens (the others zeroed). No branch: all the loads can be in flight together,
    # and a slot no token of the tile uses has its B tile masked off (never read).
    yv = tl.load(h_ptr + rows[:, None] + (n_base + owner * slot_cols + y_col0)[:, None].to(tl.int64) * stride_hn
                 + offs_r[None, :] * stride_hn, mask=has[:, None] & (offs_r < R)[None, :], other=0.0)
    b_ptrs = b_ptr + cols[:, None].to(tl.int64) * stride_bn + offs_r[None, :] * stride_br
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    if NUM_SLOTS <= 32:
        for s in tl.static_range(NUM_SLOTS):
            acc = _folded_slot(acc, yv, owner, b_ptrs, ranks_ptr, tl.full((), s, tl.int32), n_ok, offs_r,
                               stride_bs, WIDEN, IEEE)
    else:
        for s in range(NUM_SLOTS):  # (the interpreter's s is a Python int)
            acc = _folded_slot(acc, yv, owner, b_ptrs, ranks_ptr, tl.zeros((), tl.int32) + s, n_ok, offs_r,
                               stride_bs, WIDEN, IEEE)
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * stride_ot + cols[None, :] * stride_on,
             (base.to(tl.float32) + scale[:, None] * acc).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _folded_slot(acc, yv, owner, b_ptrs, ranks_ptr, s, n_ok, offs_r, stride_bs, WIDEN: tl.constexpr,
                 IEEE: tl.constexpr):
    """``acc`` plus slot ``s``'s B tile times its tokens' rows of ``yv``."""
    mine = owner == s
    used = tl.max(mine.to(tl.int32), axis=0) > 0
    bv = tl.load(b_ptrs + s.to(tl.int64) * stride_bs,
                 mask=n_ok[:, None] & ((offs_r < tl.load(ranks_ptr + s)) & used)[None, :], other=0.0)
    return acc + _product(tl.where(mine[:, None], yv, tl.zeros_like(yv)), bv, True, WIDEN, IEEE)


def folded_config(tokens: int, width: int, r: int, sms: int) -> dict[str, int]:
    """Block sizes of ``_expand_folded_kernel``: every token of a decode batch in one tile (up to
    64), 32-column tiles where 64 would leave SMs without a program (on an H200 at decode 64 x 8
    adapters, bench_sgmv.py --fold: 32 columns took 5.6-6.0 us for qkv, o and down against 5.9-6.2
    with 64, gate_up 9.9 against 8.7), products over 64 (slot, rank) pairs."""
    return dict(_folded_config(tokens, width, r, sms))


@functools.lru_cache(maxsize=256)
def _folded_config(tokens: int, width: int, r: int, sms: int) -> dict[str, int]:
    block_r = max(16, 1 << max(0, (r - 1).bit_length()))
    block_t = min(64, max(16, 1 << max(0, (tokens - 1).bit_length())))
    return dict(BLOCK_T=block_t, BLOCK_N=64 if _cdiv(width, 64) >= sms else 32, BLOCK_R=block_r,
                num_warps=8 if block_r >= 64 else 4, num_stages=1)


def sgmv_expand_folded(h: torch.Tensor, b: torch.Tensor, seg_indptr: torch.Tensor, weight_indices: torch.Tensor,
                       ranks: torch.Tensor, scalings: torch.Tensor, num_segments: int,
                       slice_offsets: Sequence[int], pdl: bool = False, one_token: bool = False,
                       config: dict[str, int] | None = None) -> torch.Tensor:
    """A new contiguous ``[T, N]``: ``h[:, :N]`` plus each token's adapter, from ``h = x @ W'^T``
    (``[T, N + k * n_slices * R]``, slot w's shrink in its columns from ``N + w * n_slices * R``, for
    the first k slots; tokens on later slots must have rank 0); ``N`` is ``slice_offsets[-1]`` and
    the slices must start at column 0. ``one_token``: segment t is exactly token t, for every
    segment (``LoraBatchInfo.one_token_segments``)."""
    padded, widths, r = _slice_plan(tuple(slice_offsets), int(slice_offsets[-1]), tuple(b.shape))
    n_base, slots = int(slice_offsets[-1]), b.shape[0]
    slot_cols = len(widths) * r
    if int(slice_offsets[0]) != 0:
        raise ValueError(f"expand_folded: slice_offsets {list(slice_offsets)} must start at column 0")
    h_slots = (h.shape[1] - n_base) // slot_cols if h.dim() == 2 else -1
    if h.dim() != 2 or not 0 <= h_slots <= slots or h.shape[1] != n_base + h_slots * slot_cols:
        raise ValueError(f"expand_folded: h {tuple(h.shape)} must be [T, N + k * n_slices * R] for k <= {slots} "
                         f"slots, N {n_base}, n_slices * R {slot_cols}")
    if b.dtype != h.dtype:
        raise ValueError(f"expand_folded: weights dtype {b.dtype} must be h's dtype {h.dtype}")
    tokens = h.shape[0]
    out = torch.empty((tokens, n_base), dtype=h.dtype, device=h.device)
    if tokens == 0 or n_base == 0:
        return out
    cfg = config or _folded_config(tokens, n_base, r, sm_count(h.device))
    tiles0, tiles01, total = _slice_bounds([_cdiv(w, cfg["BLOCK_N"]) for w in widths])
    _expand_folded_kernel[(total, _cdiv(tokens, cfg["BLOCK_T"]))](
        h, b, out, seg_indptr, weight_indices, ranks, scalings, tokens, num_segments, n_base, slot_cols, h_slots,
        *padded, tiles0, tiles01, h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        R=r, NUM_SLOTS=slots, ONE_TOKEN=one_token,
        **_segment_passes(max(1, num_segments)), WIDEN=_INTERPRETED,
        IEEE=h.dtype == torch.float32, PDL=pdl, launch_pdl=pdl, **cfg)
    return out
