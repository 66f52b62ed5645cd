"""Decode attention with the attention prologue and the split merge inside: one launch a layer.

A decode step's attention took three dependent launches after the qkv projection: the prologue
(Qwen3's q/k RMSNorm, rotary, K/V store; the CUDA platform's ``qkv_prologue``), the split-KV
stage 1 and the merge of its splits (``decode_attention.py``). At batch 1 each launch on that
chain costs more in waiting than in work. Here program ``(row, kv_head, split)`` does all three:

1. It normalizes and rotates its GQA group's query heads itself (every split of the group redoes
   it: 8 heads of 128 elements, from L2). The split holding the row's newest position also
   normalizes and rotates that position's key, stores K and V into the pool at the row's slot,
   and attends over them from registers; no other program reads that position.
2. It walks its share of the sequence as stage 1 does (``_attend_block``); with programmatic
   dependent launch the first block's keys and values (all but the newest position, which no
   kernel of this step writes) are gathered before the wait for the projection.
3. With more than one split it writes its partial output and log-sum-exp, then takes a ticket (an
   int32 counter per row and KV head, incremented with acquire/release order after a CTA
   barrier). The program drawing the last ticket merges the group's live splits, writes the
   output and puts the counter back to 0, so the counters need no reset between launches or
   CUDA-graph replays.

The prologue's arithmetic is ``engine.layers.prologue_math``'s, as the platform's kernel rounds
it, so q, K and V equal the three-launch path's; the query's and the newest key's sums of squares
are reduced over another warp layout here and the merge adds the splits in order, so the output
can differ from it in the last bits (tests compare within a float tolerance).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from engine.layers.prologue_math import fp8_saturated, head_rms_factor, neox_rotated, rms_normed
from engine_attention_triton.decode_attention import _attend_block, merge_splits
from engine_attention_triton.jit_math import block_size, check_kernel_dtype, dot_precision

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Splits whose partial outputs the merge loads in one round (independent loads in flight together).
MERGE_STEP = 4


@triton.jit
def _newest_kv(K_New, V_New, kw, kwp, row, kv_head, stride_knb, stride_vnb, c, s, eps, inv_k_scale,
               inv_v_scale, fp8_max, offs_d, mask_d, partner, first, in_rot, offs_dv, mask_dv, owner,
               HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, HAS_NORM: tl.constexpr, QUANT: tl.constexpr,
               store_dtype):
    """The newest position's key (normed, rotated) and value of ``kv_head``, as the pool stores
    them (``store_dtype``); loads masked off (no traffic) unless this program ``owner``s it."""
    k_row = K_New + row * stride_knb + kv_head * HEAD_DIM
    xk = tl.load(k_row + offs_d, mask=mask_d & owner, other=0.0)
    xkp = tl.load(k_row + partner, mask=in_rot & owner, other=0.0)
    if HAS_NORM:
        r = head_rms_factor(xk, HEAD_DIM, eps, 0)
        xk = rms_normed(xk, kw, r)
        xkp = rms_normed(xkp, kwp, r)
    k_new = neox_rotated(xk, xkp, c, s, first, in_rot)
    v_new = tl.load(V_New + row * stride_vnb + kv_head * V_DIM + offs_dv, mask=mask_dv & owner, other=0.0)
    if QUANT:
        k_new = fp8_saturated(k_new, inv_k_scale, fp8_max)
        v_new = fp8_saturated(v_new, inv_v_scale, fp8_max)
    return k_new.to(store_dtype), v_new.to(store_dtype)


@triton.jit
def _decode_prologue_kernel(
    Q, K_New, V_New, K_Buf, V_Buf, Req_To_Token, Req_Pool_Indices, Seq_Lens, Loc, Pos, Cos, Sin, QW, KW,
    Out, Part_Out, Part_Lse, Tickets,
    sm_scale, logit_cap, v_scale, inv_k_scale, inv_v_scale, fp8_max, eps, num_kv_splits,
    stride_qb, stride_knb, stride_vnb,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_r2t, stride_cos,
    stride_ob, stride_oh,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    stride_tb,
    half, rotary_dim,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_NORM: tl.constexpr, QUANT: tl.constexpr,
    DIRECT: tl.constexpr, PDL: tl.constexpr, MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
    MERGE_STEP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    dt = Q.dtype.element_ty
    if PDL:
        # The output projection next reads only its weights before its own wait: it may launch now
        # and stream them during this kernel (session 13 measured a later trigger as slower).
        tl.extra.cuda.gdc_launch_dependents()

    # -- what no kernel of this step writes: loaded before the wait for the projection ---------
    seq_len = tl.load(Seq_Lens + row).to(tl.int32)
    req = tl.load(Req_Pool_Indices + row).to(tl.int64)
    newest = seq_len - 1
    kv_lo = 0
    if SLIDING_WINDOW >= 0:
        kv_lo = tl.maximum(newest - SLIDING_WINDOW, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_lo, num_kv_splits), BLOCK_N) * BLOCK_N
    lo = kv_lo + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    owner = (lo <= newest) & (newest < hi)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    first_half = offs_d < half
    partner = tl.where(first_half, offs_d + half, offs_d - half)
    in_rot = offs_d < rotary_dim
    freq = tl.where(first_half, offs_d, offs_d - half)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_DIM
    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g
    mask_h = offs_g < GROUP

    pos = tl.load(Pos + row).to(tl.int64)
    # The cos/sin rows rounded to the activation dtype, as the rotary kernel reads them.
    c = tl.load(Cos + pos * stride_cos + freq, mask=in_rot, other=0.0).to(dt).to(tl.float32)
    s = tl.load(Sin + pos * stride_cos + freq, mask=in_rot, other=0.0).to(dt).to(tl.float32)
    qw = c
    qwp = c
    kw = c
    kwp = c
    if HAS_NORM:
        qw = tl.load(QW + offs_d, mask=mask_d, other=0.0)
        qwp = tl.load(QW + partner, mask=in_rot, other=0.0)
        kw = tl.load(KW + offs_d, mask=mask_d, other=0.0)
        kwp = tl.load(KW + partner, mask=in_rot, other=0.0)
    slot = tl.load(Loc + row).to(tl.int64)

    token_row = Req_To_Token + req * stride_r2t
    k_base = K_Buf + kv_head * stride_kh + offs_d[None, :]
    v_base = V_Buf + kv_head * stride_vh + offs_dv[None, :]
    offs_n = lo + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    loc = tl.load(token_row + offs_n, mask=mask_n, other=0).to(tl.int64)
    old = mask_n & (offs_n != newest)
    k_blk = tl.load(k_base + loc[:, None] * stride_kt, mask=old[:, None] & mask_d[None, :], other=0.0)
    v_blk = tl.load(v_base + loc[:, None] * stride_vt, mask=old[:, None] & mask_dv[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()

    # -- the prologue: the group's query heads, and the newest key and value ------------------
    q_row = Q + row * stride_qb + heads[:, None] * HEAD_DIM
    xq = tl.load(q_row + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    xqp = tl.load(q_row + partner[None, :], mask=mask_h[:, None] & in_rot[None, :], other=0.0)
    if HAS_NORM:
        r = head_rms_factor(xq, HEAD_DIM, eps, 1)[:, None]
        xq = rms_normed(xq, qw[None, :], r)
        xqp = rms_normed(xqp, qwp[None, :], r)
    q = neox_rotated(xq, xqp, c[None, :], s[None, :], first_half[None, :], in_rot[None, :])
    k_new, v_new = _newest_kv(K_New, V_New, kw, kwp, row, kv_head, stride_knb, stride_vnb, c, s, eps,
                              inv_k_scale, inv_v_scale, fp8_max, offs_d, mask_d, partner, first_half, in_rot,
                              offs_dv, mask_dv, owner, HEAD_DIM, V_DIM, HAS_NORM, QUANT,
                              K_Buf.dtype.element_ty)
    tl.store(K_Buf + slot * stride_kt + kv_head * stride_kh + offs_d, k_new, mask=mask_d & owner)
    tl.store(V_Buf + slot * stride_vt + kv_head * stride_vh + offs_dv, v_new, mask=mask_dv & owner)
    # Attended as stored (an fp8 pool's codes widen exactly to q's dtype).
    k_new = k_new.to(dt)
    v_new = v_new.to(dt)

    # -- attention over this split -------------------------------------------------------------
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    is_new = (offs_n == newest)[:, None]
    if lo < hi:
        k_first = tl.where(is_new, k_new[None, :], k_blk.to(dt))
        v_first = tl.where(is_new, v_new[None, :], v_blk.to(dt))
        m_i, l_i, acc = _attend_block(q, k_first, v_first, mask_n, m_i, l_i, acc, sm_scale, logit_cap,
                                      HAS_CAP, DOT_PRECISION)
    # Every block starts below hi, so it holds at least one live key and m_new stays finite.
    for start in range(lo + BLOCK_N, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        loc = tl.load(token_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        old = mask_n & (offs_n != newest)
        k = tl.load(k_base + loc[:, None] * stride_kt, mask=old[:, None] & mask_d[None, :], other=0.0)
        v = tl.load(v_base + loc[:, None] * stride_vt, mask=old[:, None] & mask_dv[None, :], other=0.0)
        is_new = (offs_n == newest)[:, None]
        k = tl.where(is_new, k_new[None, :], k.to(dt))
        v = tl.where(is_new, v_new[None, :], v.to(dt))
        m_i, l_i, acc = _attend_block(q, k, v, mask_n, m_i, l_i, acc, sm_scale, logit_cap, HAS_CAP,
                                      DOT_PRECISION)

    # An empty split (past the row's end) has lse = -inf: weight zero in the merge.
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    # v_scale (an fp8 pool's; 1.0 otherwise, an exact no-op) is linear: the merge keeps it.
    part = acc / l_safe[:, None] * v_scale
    out_mask = mask_h[:, None] & mask_dv[None, :]
    out_ptrs = Out + row * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
    part_base = Part_Out + row * stride_pob + heads[:, None] * stride_poh + offs_dv[None, :]
    lse_base = Part_Lse + row * stride_plb + heads * stride_plh
    if DIRECT:
        tl.store(out_ptrs, part.to(Out.dtype.element_ty), mask=out_mask)
    else:
        tl.store(part_base + split * stride_pos, part, mask=out_mask)
        tl.store(lse_base + split, tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf")), mask=mask_h)
    if MERGE and not DIRECT:
        # The CTA's stores precede the ticket (barrier, then a release at GPU scope); the last
        # program's acquire makes every split's partials visible to it.
        tl.debug_barrier()
        ticket = tl.atomic_add(Tickets + row * stride_tb + kv_head, 1, sem="acq_rel")
        if ticket == num_kv_splits - 1:
            tl.debug_barrier()
            # The merge: every live split's log-sum-exp of the group in one load, then the partial
            # outputs MERGE_STEP splits a round, their loads independent of each other (a load per
            # split, each waiting for the one before, made the merge cost more than the attention).
            # .cg: from L2, where the other SMs' partials are, not this SM's L1.
            live = tl.cdiv(seq_len - kv_lo, split_len)  # splits holding keys; the rest weigh zero
            offs_s = tl.arange(0, BLOCK_S)
            lse_all = tl.load(lse_base[:, None] + offs_s[None, :], mask=mask_h[:, None] & (offs_s < live)[None, :],
                              other=float("-inf"), cache_modifier=".cg")
            # Split 0 always holds the row's first live block, so a real head's maximum is finite.
            weights = tl.exp2(lse_all - tl.max(lse_all, 1)[:, None])
            merged = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
            for s0 in range(0, live, MERGE_STEP):
                for j in tl.static_range(MERGE_STEP):
                    o = tl.load(part_base + (s0 + j) * stride_pos, mask=out_mask & (s0 + j < live), other=0.0,
                                cache_modifier=".cg")
                    w = tl.sum(tl.where(offs_s[None, :] == s0 + j, weights, 0.0), 1)
                    merged += o * w[:, None]
            tl.store(out_ptrs, (merged / tl.sum(weights, 1)[:, None]).to(Out.dtype.element_ty), mask=out_mask)
            tl.store(Tickets + row * stride_tb + kv_head, 0)  # ready for the next launch


def _reciprocal(scale: float) -> float:
    """``1 / scale`` rounded to float32 as PyTorch's CUDA division by a host scalar computes it."""
    return float(np.float32(1.0) / np.float32(scale))


def decode_attention_prologue_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, loc: torch.Tensor, positions: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, rotary_dim: int,
    q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
    part_out: torch.Tensor, part_lse: torch.Tensor, tickets: torch.Tensor, num_kv_splits: int,
    sm_scale: float, logit_cap: float = 0.0, sliding_window_size: int = -1, *,
    k_scale: float = 1.0, v_scale: float = 1.0, block_n: int | None = None, num_warps: int = 4,
    num_stages: int = 3, pdl: bool = False, merge_in_kernel: bool = True,
) -> None:
    """Decode attention from a qkv projection's raw q/k/v: q/k norm (optional), neox rotary, the
    new K/V stored at ``loc``, split-KV attention and the merge, in one launch.

    Args:
        q: ``[batch, heads * head_dim]``, k ``[batch, kv_heads * head_dim]``, v ``[batch, kv_heads *
            v_dim]``: the projection's output (strided row views of it are fine), not changed.
        out: ``[batch, heads, v_dim]``, written.
        k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens: as ``decode_attention_fwd``.
        loc: ``[batch]`` the new tokens' KV slots; positions ``[batch]`` their positions.
        cos_cache, sin_cache, rotary_dim, q_norm_weight, k_norm_weight, eps: as ``qkv_prologue``.
        part_out, part_lse: as ``decode_attention_fwd``'s workspaces; tickets: int32 ``[>=batch,
            kv_heads]``, all 0 (every launch leaves them 0).
        num_kv_splits, sm_scale, logit_cap, sliding_window_size, k_scale, v_scale, block_n,
            num_warps, num_stages, pdl: as ``decode_attention_fwd``.
        merge_in_kernel: with more than one split, the program drawing the last ticket merges them
            (one launch); False: the splits are merged by ``decode_attention``'s merge kernel, a
            second launch (the tickets are then unused).
    """
    check_kernel_dtype(q.dtype, "q")
    batch = q.shape[0]
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    v_dim = v_buffer.shape[2]
    num_heads = q.shape[1] // head_dim
    if q.shape[1] % head_dim or num_heads % num_kv_heads or k.shape != (batch, num_kv_heads * head_dim) \
            or v.shape != (batch, num_kv_heads * v_dim):
        raise ValueError(f"decode prologue: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         f"{num_kv_heads} KV heads of dims {head_dim}/{v_dim}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"decode prologue: rotary_dim {rotary_dim}; accepted: an even number in 2..{head_dim}")
    if not 1 <= num_kv_splits <= part_lse.shape[2] or tickets.shape[0] < batch or tickets.shape[1] < num_kv_heads:
        raise ValueError(f"decode prologue: num_kv_splits={num_kv_splits}, tickets {tuple(tickets.shape)} for "
                         f"{batch} rows of {num_kv_heads} KV heads; the workspace holds 1..{part_lse.shape[2]} splits")
    if any(t.stride(-1) != 1 for t in (q, k, v, out, k_buffer, v_buffer)):
        raise ValueError("decode prologue: q, k, v, out and the pool need unit stride in the last dimension")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("decode prologue: q_norm_weight and k_norm_weight are given together or not at all")
    if batch == 0:
        return
    quant = k_buffer.dtype in _FP8
    has_norm = q_norm_weight is not None
    group = num_heads // num_kv_heads
    if block_n is None:
        block_n = 32 if head_dim > 128 or q.dtype == torch.float32 else 64
    direct = num_kv_splits == 1
    _decode_prologue_kernel[(batch, num_kv_heads, num_kv_splits)](
        q, k, v, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, loc, positions,
        cos_cache, sin_cache, q_norm_weight if has_norm else q, k_norm_weight if has_norm else q,
        out, part_out, part_lse, tickets,
        sm_scale * k_scale, logit_cap, float(v_scale),
        _reciprocal(k_scale) if quant else 1.0, _reciprocal(v_scale) if quant else 1.0,
        float(torch.finfo(k_buffer.dtype).max) if quant else 0.0, eps, num_kv_splits,
        q.stride(0), k.stride(0), v.stride(0),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), cos_cache.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        tickets.stride(0),
        rotary_dim // 2, rotary_dim,
        GROUP=group, BLOCK_H=block_size(group), BLOCK_N=block_n, HEAD_DIM=head_dim, V_DIM=v_dim,
        BLOCK_D=block_size(head_dim), BLOCK_DV=block_size(v_dim),
        SLIDING_WINDOW=sliding_window_size if sliding_window_size >= 0 else -1,
        HAS_CAP=logit_cap > 0, DOT_PRECISION=dot_precision(q.dtype), HAS_NORM=has_norm, QUANT=quant,
        DIRECT=direct, PDL=pdl, MERGE=merge_in_kernel, BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)),
        MERGE_STEP=MERGE_STEP, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
    if not direct and not merge_in_kernel:
        merge_splits(part_out, part_lse, out, num_kv_splits, pdl)


__all__ = ["decode_attention_prologue_fwd"]
