"""Extend (prefill) attention: new tokens over their row's cached prefix and themselves.

One program per (query head, block of ``BLOCK_M`` new tokens, row). It runs one
online softmax over two key ranges in turn:

1. the row's cached prefix, positions ``0..prefix_len-1``, gathered from the paged
   pool through ``req_to_token`` (every key is visible to every new token, except
   where a sliding window cuts it off);
2. the row's new tokens, read from the contiguous ``k``/``v`` the layer just
   computed, masked causally; the loop stops at the block's last query, so the
   upper triangle is never loaded. With a tree mask (speculative tree verification)
   the causal mask is further cut by the row's ``[n, n]`` ancestor matrix, read from
   ``Tree_Mask`` at ``Tree_Mask_Indptr[row]`` (a subset of the causal mask, so the
   loop bounds stay the same; only the unmasked fast path is skipped).

Query heads vary fastest in the launch grid, so the heads of one GQA group run side
by side and their repeated reads of the same K/V tiles hit L2. Decode rows of a
MIXED batch are rows with one new token and need nothing special.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from engine_attention_triton.jit_math import (
    base2_scores,
    block_size,
    check_kernel_dtype,
    dot_precision,
)

logger = logging.getLogger(__name__)


@triton.jit
def _fold_block(q, k, v, keep, m_i, l_i, acc, sm_scale, logit_cap,
                MASKED: tl.constexpr, HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Folds one K/V block into the online-softmax state (``keep`` used when MASKED)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    qk = base2_scores(qk, sm_scale, logit_cap, HAS_CAP)
    if MASKED:
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A query row may see no key of this block (causal/window mask, padding rows);
        # subtracting 0 instead of -inf keeps exp2 at 0 instead of NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


# The per-row index and length vectors are read as scalars: their 16-byte alignment buys nothing,
# and specializing on it compiles a second variant whenever a caller's vector is a slice at an odd
# offset (as warm_extend's were, or a sub-batch's).
@triton.jit(do_not_specialize_on_alignment=["Req_Pool_Indices", "Prefix_Lens", "Extend_Lens", "Extend_Start",
                                            "Tree_Mask", "Tree_Mask_Indptr"])
def _extend_kernel(
    Q, K_New, V_New, Out, K_Buf, V_Buf, Req_To_Token,
    Req_Pool_Indices, Prefix_Lens, Extend_Lens, Extend_Start,
    Tree_Mask, Tree_Mask_Indptr,
    sm_scale, logit_cap, v_scale,
    stride_qt, stride_qh,
    stride_knt, stride_knh,
    stride_vnt, stride_vnh,
    stride_ot, stride_oh,
    stride_kbt, stride_kbh,
    stride_vbt, stride_vbh,
    stride_r2t,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TREE_MASK: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
):
    head = tl.program_id(0)
    if HEAVY_FIRST:
        # Grid (heads, rows, query blocks), the last query blocks (the most causal work) launched
        # first, so the light ones fill the end of the launch instead of a few heavy ones alone.
        row = tl.program_id(1).to(tl.int64)
        m_start = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    else:
        m_start = tl.program_id(1) * BLOCK_M
        row = tl.program_id(2).to(tl.int64)

    ext_len = tl.load(Extend_Lens + row).to(tl.int32)
    # The grid covers the longest row; shorter rows have nothing in their later blocks.
    if m_start >= ext_len:
        return
    prefix_len = tl.load(Prefix_Lens + row).to(tl.int32)
    tok0 = tl.load(Extend_Start + row).to(tl.int64)
    req = tl.load(Req_Pool_Indices + row).to(tl.int64)
    kv_head = head // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_DIM
    q_pos = prefix_len + offs_m
    k_cols = kv_head * stride_kbh + offs_d[None, :]
    v_cols = kv_head * stride_vbh + offs_dv[None, :]
    kn_cols = kv_head * stride_knh + offs_d[None, :]
    vn_cols = kv_head * stride_vnh + offs_dv[None, :]

    q = tl.load(
        Q + (tok0 + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    token_row = Req_To_Token + req * stride_r2t

    # -- 1. the cached prefix, gathered from the pool ---------------------------
    # Whole blocks need no score mask (only without a window); the rest are masked.
    masked_lo = 0
    if SLIDING_WINDOW >= 0:
        # The block's first query (at prefix_len + m_start) sees nothing before this.
        masked_lo = tl.maximum(prefix_len + m_start - SLIDING_WINDOW, 0)
    else:
        masked_lo = (prefix_len // BLOCK_N) * BLOCK_N
        for start in range(0, masked_lo, BLOCK_N):
            loc = tl.load(token_row + start + tl.arange(0, BLOCK_N)).to(tl.int64)
            k = tl.load(K_Buf + loc[:, None] * stride_kbt + k_cols, mask=mask_d[None, :],
                        other=0.0).to(q.dtype)
            v = tl.load(V_Buf + loc[:, None] * stride_vbt + v_cols, mask=mask_dv[None, :],
                        other=0.0).to(q.dtype)
            m_i, l_i, acc = _fold_block(q, k, v, 0, m_i, l_i, acc, sm_scale, logit_cap,
                                        False, HAS_CAP, DOT_PRECISION)
    for start in range(masked_lo, prefix_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        loc = tl.load(token_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_Buf + loc[:, None] * stride_kbt + k_cols,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
        v = tl.load(V_Buf + loc[:, None] * stride_vbt + v_cols,
                    mask=mask_n[:, None] & mask_dv[None, :], other=0.0).to(q.dtype)
        keep = mask_n[None, :]
        if SLIDING_WINDOW >= 0:
            keep = keep & (q_pos[:, None] - offs_n[None, :] <= SLIDING_WINDOW)
        m_i, l_i, acc = _fold_block(q, k, v, keep, m_i, l_i, acc, sm_scale, logit_cap,
                                    True, HAS_CAP, DOT_PRECISION)

    # -- 2. the new tokens themselves, causal -----------------------------------
    # Blocks wholly before this query block are fully visible: no mask (without a
    # window, and when BLOCK_N divides BLOCK_M so no block straddles m_start).
    masked_lo = 0
    if SLIDING_WINDOW >= 0:
        masked_lo = tl.maximum(m_start - SLIDING_WINDOW, 0)
    elif TREE_MASK:
        masked_lo = 0  # every block is masked: the ancestor matrix decides
    elif BLOCK_M % BLOCK_N == 0:
        masked_lo = m_start
        for start in range(0, m_start, BLOCK_N):
            offs_n = tok0 + start + tl.arange(0, BLOCK_N)
            k = tl.load(K_New + offs_n[:, None] * stride_knt + kn_cols, mask=mask_d[None, :],
                        other=0.0).to(q.dtype)
            v = tl.load(V_New + offs_n[:, None] * stride_vnt + vn_cols, mask=mask_dv[None, :],
                        other=0.0).to(q.dtype)
            m_i, l_i, acc = _fold_block(q, k, v, 0, m_i, l_i, acc, sm_scale, logit_cap,
                                        False, HAS_CAP, DOT_PRECISION)
    # The loop stops at the block's last query: the upper triangle is never loaded.
    hi = tl.minimum(ext_len, m_start + BLOCK_M)
    for start in range(masked_lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        k = tl.load(K_New + (tok0 + offs_n)[:, None] * stride_knt + kn_cols,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
        v = tl.load(V_New + (tok0 + offs_n)[:, None] * stride_vnt + vn_cols,
                    mask=mask_n[:, None] & mask_dv[None, :], other=0.0).to(q.dtype)
        keep = mask_n[None, :] & (offs_m[:, None] >= offs_n[None, :])
        if SLIDING_WINDOW >= 0:
            keep = keep & (offs_m[:, None] - offs_n[None, :] <= SLIDING_WINDOW)
        if TREE_MASK:
            tree0 = tl.load(Tree_Mask_Indptr + row).to(tl.int64)
            allowed = tl.load(Tree_Mask + tree0 + offs_m[:, None] * ext_len + offs_n[None, :],
                              mask=mask_m[:, None] & mask_n[None, :], other=0)
            keep = keep & (allowed != 0)
        m_i, l_i, acc = _fold_block(q, k, v, keep, m_i, l_i, acc, sm_scale, logit_cap,
                                    True, HAS_CAP, DOT_PRECISION)

    # Every live query sees at least itself, so l_i > 0 on the rows that are stored.
    # v_scale: an fp8 pool's (every V here, new tokens' included, came from it); else 1.0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    tl.store(
        Out + (tok0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_dv[None, :],
    )


#: Widen an fp8 pool's new-token K/V to q's dtype before the kernel (``extend_attention_fwd``).
#: H200, 8 x 1,024 new tokens at Llama-3-8B heads over an e4m3 pool: 313 us + 58 us for the
#: widening against 403 us widening in the kernel (benchmarks/bench_kernels.py --extend-fp8).
WIDEN_NEW_KV_FIRST = True
#: ... and the backend reads them back from the pool widened in one launch (``gather_widened``)
#: instead of a gather and a cast of K and of V.
GATHER_WIDENED = True


#: Launch each row's last query blocks first (``_extend_kernel``'s HEAVY_FIRST): under the causal
#: mask block j of a row attends to j + 1 blocks of keys.
HEAVY_BLOCKS_FIRST = True


#: Extends at least this long (prefill chunks) take 128-row tiles (``default_extend_config``).
LONG_EXTEND = 512


def default_extend_config(head_dim: int, dtype: torch.dtype,
                          max_extend_len: int = 0) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for the extend kernel on this shape."""
    if dtype == torch.float32:
        # Full-precision tiles are twice the bytes and registers of 16-bit ones.
        return 32, 32, 4, 2
    if head_dim > 128:
        return 64, 32, 4, 2
    if max_extend_len >= LONG_EXTEND:
        # H200, a prefill chunk of 8 x 1,024 new tokens at Llama-3-8B heads (benchmarks/bench_kernels.py
        # --extend-fp8): 265 us with 128-row tiles and 8 warps against 313 us with the tiles below.
        return 128, 64, 8, 3
    # Measured on an H100 at Llama-3-8B shapes (benchmarks/bench_kernels.py --sweep): 64x64 tiles,
    # 4 warps, 3 pipeline stages beat 128-row tiles and 8 warps at every shape tried.
    return 64, 64, 4, 3


def extend_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    sliding_window_size: int = -1,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    config: tuple[int, int, int, int] | None = None,
    tree_mask: torch.Tensor | None = None,
    tree_mask_indptr: torch.Tensor | None = None,
) -> None:
    """Causal attention of each row's new tokens over its cached prefix and themselves.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; ``k``, ``v``: the new tokens' keys and
            values ``[num_tokens, num_kv_heads, head_dim|v_dim]`` (rows laid out back to
            back as ``extend_start_loc`` says; last dims contiguous, other strides free).
        out: ``[num_tokens, num_heads, v_dim]``, written in place.
        k_buffer, v_buffer: one layer's pool ``[rows, num_kv_heads, head_dim|v_dim]``
            holding each row's prefix at ``req_to_token[req, 0:prefix_len]``.
        req_pool_indices, prefix_lens, extend_seq_lens, extend_start_loc: ``[batch]``.
        max_extend_len: the largest ``extend_seq_lens`` entry (host int: sizes the grid).
        sm_scale, logit_cap, sliding_window_size: as for decode attention.
        k_scale, v_scale: with an fp8 KV cache, ``k``/``v`` and the pool both hold float8
            ``x / scale`` (the new tokens read back from the pool); the kernel widens them to
            q's dtype, folds ``k_scale`` into the softmax scale and multiplies the output by
            ``v_scale``, in float32. 1.0 otherwise.
        config: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` override for benchmarking.
        tree_mask, tree_mask_indptr: speculative tree verification (``ForwardBatch.tree_mask``):
            bool ``[sum n_i^2]``, row i's ``[n_i, n_i]`` ancestor matrix (row-major) at
            ``tree_mask_indptr[i]``; new token a attends to new token b only where ``m[a, b]``.
            Not combined with a sliding window (the window compares indices, and a tree
            node's position is its depth).
    """
    check_kernel_dtype(q.dtype, "q")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    v_dim = v.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"extend attention: num_heads={num_heads} is not a multiple of "
            f"num_kv_heads={num_kv_heads}"
        )
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("k_buffer", k_buffer),
                    ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"extend attention: {name} needs a contiguous last dim")
    batch = extend_seq_lens.shape[0]
    if batch == 0 or num_tokens == 0 or max_extend_len <= 0:
        return
    block_m, block_n, num_warps, num_stages = config or default_extend_config(head_dim, q.dtype, max_extend_len)
    if WIDEN_NEW_KV_FIRST and k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # An fp8 pool's new tokens, widened once here (exact) instead of in the kernel, where every
        # query head of a GQA group and every block of queries converts each block of keys again.
        k, v = k.to(q.dtype), v.to(q.dtype)
    has_tree = tree_mask is not None
    if has_tree:
        if tree_mask_indptr is None:
            raise ValueError("extend attention: tree_mask needs tree_mask_indptr")
        if sliding_window_size >= 0:
            raise ValueError("extend attention: a tree mask with a sliding window is not supported")
        tree_mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    else:
        # Unused (TREE_MASK is off); any tensor stands in for the pointers.
        tree_mask = tree_mask_indptr = extend_seq_lens

    m_blocks = triton.cdiv(max_extend_len, block_m)
    grid = (num_heads, batch, m_blocks) if HEAVY_BLOCKS_FIRST else (num_heads, m_blocks, batch)
    _extend_kernel[grid](
        q, k, v, out, k_buffer, v_buffer, req_to_token,
        req_pool_indices, prefix_lens, extend_seq_lens, extend_start_loc,
        tree_mask, tree_mask_indptr,
        sm_scale * k_scale, logit_cap, float(v_scale),
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        V_DIM=v_dim,
        BLOCK_D=block_size(head_dim),
        BLOCK_DV=block_size(v_dim),
        SLIDING_WINDOW=sliding_window_size if sliding_window_size >= 0 else -1,
        HAS_CAP=logit_cap > 0,
        DOT_PRECISION=dot_precision(q.dtype),
        TREE_MASK=has_tree,
        HEAVY_FIRST=HEAVY_BLOCKS_FIRST,
        num_warps=num_warps,
        num_stages=num_stages,
    )


@triton.jit(do_not_specialize_on_alignment=["Loc"])
def _gather_widen_kernel(K_Buf, V_Buf, Loc, K_Out, V_Out, stride_kbt, stride_vbt,
                         K_ROW: tl.constexpr, V_ROW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # One program per new token: its pool row of K and of V (all KV heads), widened.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    k = tl.load(K_Buf + slot * stride_kbt + offs, mask=offs < K_ROW)
    tl.store(K_Out + t * K_ROW + offs, k.to(K_Out.dtype.element_ty), mask=offs < K_ROW)
    offs = tl.arange(0, BLOCK_V)
    v = tl.load(V_Buf + slot * stride_vbt + offs, mask=offs < V_ROW)
    tl.store(V_Out + t * V_ROW + offs, v.to(V_Out.dtype.element_ty), mask=offs < V_ROW)


@functools.cache
def _warn_strided_pool_rows() -> None:
    logger.warning("triton extend: the fp8 pool's rows do not hold their KV heads back to back; its new "
                   "tokens are read back by torch gathers and casts instead of gather_widened's one launch")


def gather_widened(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``k_buffer[loc].to(dtype), v_buffer[loc].to(dtype)`` in one launch: an fp8 pool's new tokens
    read back and widened (exact) for the extend kernel, instead of two gathers and two casts.
    Pool rows whose heads are not back to back take the torch ops."""
    if not (k_buffer[0].is_contiguous() and v_buffer[0].is_contiguous()):
        _warn_strided_pool_rows()
        return k_buffer[loc].to(dtype), v_buffer[loc].to(dtype)
    n = loc.shape[0]
    k_out = torch.empty((n, *k_buffer.shape[1:]), dtype=dtype, device=k_buffer.device)
    v_out = torch.empty((n, *v_buffer.shape[1:]), dtype=dtype, device=v_buffer.device)
    if n:
        k_row, v_row = k_buffer[0].numel(), v_buffer[0].numel()
        _gather_widen_kernel[(n,)](k_buffer, v_buffer, loc, k_out, v_out, k_buffer.stride(0), v_buffer.stride(0),
                                   K_ROW=k_row, V_ROW=v_row, BLOCK_K=triton.next_power_of_2(k_row),
                                   BLOCK_V=triton.next_power_of_2(v_row), num_warps=4)
    return k_out, v_out


@torch.no_grad()
def warm_extend(q_dtype: torch.dtype, num_heads: int, head_dim: int, v_dim: int, k_buffer: torch.Tensor,
                v_buffer: torch.Tensor, req_to_token: torch.Tensor, logit_cap: float = 0.0,
                sliding_window_size: int = -1) -> None:
    """Compiles the extend kernel's variants for these heads before serving: a prefill chunk's
    (``LONG_EXTEND`` new tokens and more) and a short extend's tiles, on scratch queries and new
    K/V over the real pool (no prefix: the pool and ``req_to_token`` are passed, not read), with the
    argument dtypes and alignments the backend's calls have. Triton otherwise compiles each on its
    first use, inside the first requests (a second or so each on an H200 host)."""
    device = k_buffer.device
    num_kv_heads = k_buffer.shape[1]
    if k_buffer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        gather_widened(k_buffer, v_buffer, torch.zeros(16, dtype=torch.int64, device=device), q_dtype)
    for n in (LONG_EXTEND, 16):
        q = torch.zeros(n, num_heads, head_dim, dtype=q_dtype, device=device)
        k = torch.zeros(n, num_kv_heads, head_dim, dtype=k_buffer.dtype, device=device)
        v = torch.zeros(n, num_kv_heads, v_dim, dtype=v_buffer.dtype, device=device)
        # One tensor each, as ForwardBatch.build makes them (see the kernel's alignment note).
        rows, prefix, lens, start = (torch.tensor([v], dtype=torch.int64, device=device) for v in (0, 0, n, 0))
        extend_attention_fwd(q, k, v, torch.empty(n, num_heads, v_dim, dtype=q_dtype, device=device), k_buffer,
                             v_buffer, req_to_token, rows, prefix, lens, start, n, head_dim**-0.5,
                             logit_cap, sliding_window_size)


__all__ = ["default_extend_config", "extend_attention_fwd", "gather_widened", "warm_extend"]
