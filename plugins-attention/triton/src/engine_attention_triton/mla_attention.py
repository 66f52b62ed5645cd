"""Attention over the "mla" KV layout (DeepSeek's multi-head latent attention, absorbed form).

The pool holds ONE buffer per layer, ``[slots, 1, lora + rope]``: each token's compressed latent
``c_kv`` (``lora`` = kv_lora_rank, 512 for DeepSeek) followed by its roped key ``k_pe`` (``rope``,
64). Every query head attends to that single KV head with ``q = [q_nope @ W_UK || q_pe]``, and the
values are the latent itself, the buffer's leading ``lora`` dims. So the kernels load two tiles per
block of keys, the latent ``[BLOCK_N, lora]`` and the rope part ``[BLOCK_N, rope]``; scores are
``q_c . c + q_r . r``, and the latent tile already loaded is multiplied into the output as V. Each
dim is padded to its own power of two (576 = 512 + 64 pads to nothing, where one 576-wide tile
would pad to 1024).

Decode: one program per (row, block of ``BLOCK_H`` query heads, split): the whole head block reads
each latent block once, which is the point of MLA (one KV row serves all heads). The splits are
merged by the MHA decode's merge kernel. Extend: one program per (query head, block of new tokens,
row), over the cached prefix gathered from the pool and then the new tokens causally (read from the
layer's contiguous K, or from the pool when it stores fp8), with an optional tree mask.

An fp8 pool is widened to q's dtype (exact); the latent's scale ``kv_scale`` multiplies the scores
(folded into the softmax scale) and the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_attention_triton.decode_attention import _decode_merge_kernel
from engine_attention_triton.jit_math import (
    base2_scores,
    block_size,
    check_kernel_dtype,
    dot_precision,
    gathers_words,
    widen_e4m3_words,
)


@triton.jit
def _mla_fold(q_c, q_r, c, r, keep, m_i, l_i, acc, sm_scale, logit_cap,
              HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One block of latent ``c`` and rope keys ``r`` (``keep``: visible scores) into the online
    softmax; the latent is also the block's values."""
    qk = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
    qk += tl.dot(q_r, tl.trans(r), input_precision=DOT_PRECISION)
    qk = tl.where(keep, base2_scores(qk, sm_scale, logit_cap, HAS_CAP), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A query may see no key of this block (causal mask, padding): exp2 of -inf - 0, never NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _kv_ptrs(KV, loc, stride_t, offs_c, offs_r, LORA: tl.constexpr, WORDS: tl.constexpr):
    """Addresses of the latent and rope tiles of the slots ``loc`` (``WORDS``: as int32 words of
    four e4m3 values; ``offs_c``/``offs_r`` then count words)."""
    if WORDS:
        base = KV.to(tl.pointer_type(tl.int32), bitcast=True) + loc[:, None] * (stride_t // 4)
        return base + offs_c[None, :], base + LORA // 4 + offs_r[None, :]
    else:
        base = KV + loc[:, None] * stride_t
        return base + offs_c[None, :], base + LORA + offs_r[None, :]


@triton.jit
def _kv_col_masks(offs_c, mask_c, offs_r, mask_r, LORA: tl.constexpr, ROPE: tl.constexpr, WORDS: tl.constexpr):
    if WORDS:
        return offs_c < LORA // 4, offs_r < ROPE // 4
    else:
        return mask_c, mask_r


@triton.jit
def _gather_kv(KV, loc, stride_t, mask_n, offs_c, mask_c, offs_r, mask_r, LORA: tl.constexpr, ROPE: tl.constexpr,
               WORDS: tl.constexpr = False):
    """The latent and rope tiles of the slots ``loc`` as stored (``WORDS``: int32 words)."""
    c_ptrs, r_ptrs = _kv_ptrs(KV, loc, stride_t, offs_c, offs_r, LORA, WORDS)
    cols_c, cols_r = _kv_col_masks(offs_c, mask_c, offs_r, mask_r, LORA, ROPE, WORDS)
    if WORDS:
        c = tl.load(c_ptrs, mask=mask_n[:, None] & cols_c[None, :], other=0)
        r = tl.load(r_ptrs, mask=mask_n[:, None] & cols_r[None, :], other=0)
    else:
        c = tl.load(c_ptrs, mask=mask_n[:, None] & cols_c[None, :], other=0.0)
        r = tl.load(r_ptrs, mask=mask_n[:, None] & cols_r[None, :], other=0.0)
    return c, r


@triton.jit
def _widen_kv(c, r, dtype: tl.constexpr, WORDS: tl.constexpr = False):
    """Gathered tiles in q's dtype: an e4m3 pool's int32 words widened on the integer pipe
    (``widen_e4m3_words``, exact), else converted."""
    if WORDS:
        return widen_e4m3_words(c), widen_e4m3_words(r)
    else:
        return c.to(dtype), r.to(dtype)


@triton.jit
def _load_kv(KV, loc, stride_t, mask_n, offs_c, mask_c, offs_r, mask_r, LORA: tl.constexpr, ROPE: tl.constexpr,
             dtype: tl.constexpr, WORDS: tl.constexpr = False):
    """The latent and rope tiles of the slots ``loc``, in q's dtype. ``WORDS``: an e4m3 pool under
    bf16 queries, gathered as int32 words (four values each) and widened on the integer pipe
    (``widen_e4m3_words``), exactly; ``offs_c``/``offs_r`` then count words."""
    c, r = _gather_kv(KV, loc, stride_t, mask_n, offs_c, mask_c, offs_r, mask_r, LORA, ROPE, WORDS)
    return _widen_kv(c, r, dtype, WORDS)


@triton.jit
def _mla_decode_split_kernel(
    Q, KV, Req_To_Token, Req_Pool_Indices, Seq_Lens, Part_Out, Part_Lse,
    sm_scale, logit_cap, out_scale, num_kv_splits,
    stride_qb, stride_qh, stride_kvt, stride_r2t,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr,
    WIDEN: tl.constexpr, SLOTS_AHEAD: tl.constexpr, PDL: tl.constexpr, EARLY_KV: tl.constexpr = False,
):
    # DIRECT (one split): Part_Out is the output; no log-sum-exp, no merge pass.
    # WIDEN (an fp8 pool's tiles into the dots): 0, to q's dtype by Triton; 1, an e4m3 pool
    # gathered as int32 words (``_load_kv``) and widened to bf16; 2, to float16 (one conversion per
    # pair of values), with q converted to float16 too.
    # SLOTS_AHEAD: each block's slots are loaded one block early, so its rows' addresses are known
    # when the block starts and Triton's pipeliner keeps num_stages - 1 blocks of gathers in flight
    # (loading them in the same block makes the gathers wait on the slots: one buffer).
    # PDL: the next launch (the merge, or the output's W_UV product) may start at once; the row's
    # length, request and slots (written before the step's kernels) are read before the wait for
    # the kernel before (the prologue, which writes q and the newest row).
    # EARLY_KV: the split's first block of rows is gathered before that wait too, all but the
    # row's newest token (the prologue's store), which is gathered into the tile after it; the
    # older rows were stored by earlier steps. At batch 1 a split is often one block: its gathers
    # then leave the chain's critical path.
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    seq_len = tl.load(Seq_Lens + row).to(tl.int32)
    req = tl.load(Req_Pool_Indices + row).to(tl.int64)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    mask_h = heads < NUM_HEADS
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < LORA
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE
    token_row = Req_To_Token + req * stride_r2t
    if WIDEN == 1:  # the tiles' columns counted in words of four values
        offs_cl = tl.arange(0, BLOCK_C // 4)
        offs_rl = tl.arange(0, BLOCK_R // 4)
    else:
        offs_cl = offs_c
        offs_rl = offs_r
    # The loop's first block (past the peeled one with EARLY_KV).
    first = lo
    if EARLY_KV:
        first = lo + BLOCK_N
        offs_n0 = lo + tl.arange(0, BLOCK_N)
        mask_n0 = offs_n0 < hi
        loc0 = tl.load(token_row + offs_n0, mask=mask_n0, other=0).to(tl.int64)
        c0, r0 = _gather_kv(KV, loc0, stride_kvt, mask_n0 & (offs_n0 < seq_len - 1), offs_cl, mask_c, offs_rl,
                            mask_r, LORA, ROPE, WIDEN == 1)
    if SLOTS_AHEAD:
        offs_nx = first + tl.arange(0, BLOCK_N)
        loc_nx = tl.load(token_row + offs_nx, mask=offs_nx < hi, other=0)
    else:
        loc_nx = tl.zeros([BLOCK_N], dtype=tl.int32)  # unused
    if PDL:
        tl.extra.cuda.gdc_wait()
    q_row = Q + row * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_row + LORA + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    if WIDEN == 2:
        # bf16 -> f16 is exact within f16's range; beyond it a score would be inf, so q saturates.
        q_c = tl.clamp(q_c.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        q_r = tl.clamp(q_r.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    if EARLY_KV:
        # The newest token's row into the gathered tile (the other rows keep their values), then
        # the block folds as any other (an empty split's folds nothing: every score masked).
        c_ptrs, r_ptrs = _kv_ptrs(KV, loc0, stride_kvt, offs_cl, offs_rl, LORA, WIDEN == 1)
        cols_c, cols_r = _kv_col_masks(offs_cl, mask_c, offs_rl, mask_r, LORA, ROPE, WIDEN == 1)
        newest = (mask_n0 & (offs_n0 == seq_len - 1))[:, None]
        c0 = tl.load(c_ptrs, mask=newest & cols_c[None, :], other=c0)
        r0 = tl.load(r_ptrs, mask=newest & cols_r[None, :], other=r0)
        c, r = _widen_kv(c0, r0, q_c.dtype, WIDEN == 1)
        m_i, l_i, acc = _mla_fold(q_c, q_r, c, r, mask_n0[None, :], m_i, l_i, acc, sm_scale, logit_cap,
                                  HAS_CAP, DOT_PRECISION)
    for start in range(first, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        if SLOTS_AHEAD:
            loc = loc_nx.to(tl.int64)
            offs_nx = offs_n + BLOCK_N
            loc_nx = tl.load(token_row + offs_nx, mask=offs_nx < hi, other=0)
        else:
            loc = tl.load(token_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        c, r = _load_kv(KV, loc, stride_kvt, mask_n, offs_cl, mask_c, offs_rl, mask_r, LORA, ROPE, q_c.dtype,
                        WIDEN == 1)
        m_i, l_i, acc = _mla_fold(q_c, q_r, c, r, mask_n[None, :], m_i, l_i, acc, sm_scale, logit_cap,
                                  HAS_CAP, DOT_PRECISION)

    # An empty split (past the row's end) writes zeros and lse = -inf: weight zero in the merge.
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out_base = Part_Out + row * stride_pob + split * stride_pos
    tl.store(out_base + heads[:, None] * stride_poh + offs_c[None, :],
             (acc / l_safe[:, None] * out_scale).to(Part_Out.dtype.element_ty),
             mask=mask_h[:, None] & mask_c[None, :])
    if not DIRECT:
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Part_Lse + row * stride_plb + heads * stride_plh + split, lse, mask=mask_h)


#: How the decode kernel widens an fp8 pool's tiles (``mla_decode_fwd``'s ``widen``).
_WIDEN = {"cvt": 0, "words": 1, "f16": 2}

#: Query heads a decode program holds: DeepSeek-V2-Lite's 16 in one block; more heads (V3's 128,
#: or fewer per rank under TP) take several blocks, each reading the latent once.
MLA_DECODE_BLOCK_H = 16
#: Decode batches of up to this many rows over a 16-bit pool with PDL gather each split's first
#: block before the wait, in blocks of 16 keys (``mla_decode_fwd``'s ``early_kv``); measured at 1 row.
MLA_EARLY_KV_MAX_ROWS = 4


def mla_head_blocks(num_heads: int, block_h: int = MLA_DECODE_BLOCK_H) -> int:
    """Programs per row and split of the decode kernel (what the split heuristic counts as KV heads)."""
    return triton.cdiv(num_heads, block_h)


def mla_decode_fwd(
    q: torch.Tensor, kv_buffer: torch.Tensor, out: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
    num_kv_splits: int, sm_scale: float, kv_lora_rank: int, logit_cap: float = 0.0, *,
    kv_scale: float = 1.0, block_h: int = MLA_DECODE_BLOCK_H, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, slots_ahead: bool | None = None,
    widen: str | None = None, pdl: bool = False, early_kv: bool | None = None,
) -> None:
    """Decode attention of ``q`` ``[batch, num_heads, lora + rope]`` over each row's whole sequence
    in the MLA pool ``kv_buffer`` ``[slots, 1, lora + rope]`` (the new token already saved there),
    writing ``out`` ``[batch, num_heads, lora]``. The workspaces and ``num_kv_splits`` are those of
    ``decode_attention_fwd`` with ``v_dim = lora``; ``kv_scale``: an fp8 pool's scale. The tiles
    (``block_h`` heads by ``block_n`` keys) compile for sm_90 at DeepSeek's 16 heads and 512 + 64
    dims without register spills. A 16-bit pool: the plain loop with 4 warps and 2 stages at more
    than 4 splits (small batches), the slots-ahead loop with 4 warps and 3 stages at up to 4 (on an
    H200 at 256 rows of 2,048 tokens, 3 splits: 191.6 us, 0.74 of the read bound, against 204.0).

    An fp8 pool under 16-bit queries is never widened by Triton's own conversion (``widen="cvt"``,
    through f16 with one slow F2F per value: 514.9-518.2 us at that size, 0.14 of the bound): an
    e4m3 pool under bf16 queries is gathered as int32 words and widened on the integer pipe
    (``"words"``: 313.5 us, slots-ahead, 4 warps, 3 stages); otherwise it is widened to float16,
    one conversion per pair, with q converted to float16, exact in its range and saturated beyond
    (``"f16"``: 412.0 us for e4m3 at that size, slots-ahead, 8 warps: 4 spill). Both remain
    issue-bound well above the 70.9 us of reads. ``widen``, ``slots_ahead``, ``num_warps``,
    ``num_stages``: overrides (benchmarks, tests). ``pdl`` (sm_90+, the backend's ``triton.pdl``):
    both launches are programmatic dependent ones; the split kernel lets the next launch start at
    once and reads the row's slots before its wait, the merge triggers and then waits. ``early_kv``:
    each split also gathers its first block of cached rows before that wait, all but the row's
    newest token (stored by the kernel before), which it gathers after it; by default with PDL, a
    16-bit pool, 16-bit queries and the plain loop at up to ``MLA_EARLY_KV_MAX_ROWS`` rows, in
    blocks of 16 keys (``block_n``, else 32). DeepSeek-V2-Lite's attention chain at batch 1 (192
    tokens, 16 splits, H200, ``bench_mla_chain.py``, 2026-11-29): 18.05 us a layer against 18.73-19.03
    with 32-key blocks gathered after the wait, 18.52 with 16-key blocks alone, 18.93 with the early
    gather alone (8 warps)."""
    check_kernel_dtype(q.dtype, "q")
    batch, num_heads, head_dim = q.shape
    _check_mla_shapes(q, kv_buffer, kv_lora_rank, "decode")
    if num_kv_splits < 1 or num_kv_splits > part_lse.shape[2]:
        raise ValueError(f"mla decode: num_kv_splits={num_kv_splits}; the workspace holds 1..{part_lse.shape[2]}")
    if out.stride(-1) != 1:
        raise ValueError("mla decode: out needs a contiguous last dim")
    if batch == 0:
        return
    rope = head_dim - kv_lora_rank
    direct = num_kv_splits == 1
    dest = out if direct else part_out
    dest_strides = (out.stride(0), out.stride(1), 0) if direct else (
        part_out.stride(0), part_out.stride(1), part_out.stride(2))
    block_h = min(block_h, block_size(num_heads))
    fp8 = kv_buffer.element_size() == 1
    words_fit = kv_lora_rank % 4 == 0 and gathers_words(q, kv_buffer, kv_buffer)
    if widen is None:
        widen = "cvt" if not fp8 or q.dtype == torch.float32 else "words" if words_fit else "f16"
    if widen not in _WIDEN or (widen == "words" and not words_fit):
        raise ValueError(f"mla decode: widen={widen!r} for a {kv_buffer.dtype} pool and {q.dtype} q; accepted: "
                         "cvt, f16, words (an e4m3 pool, bf16 q, 4-aligned rows, sm_80+ compiled)")
    if slots_ahead is None:
        slots_ahead = widen != "cvt" if fp8 else num_kv_splits <= 4 and q.dtype != torch.float32
    if num_stages is None:
        num_stages = 3 if slots_ahead else 2
    if early_kv is None:
        early_kv = (pdl and not fp8 and not slots_ahead and q.dtype != torch.float32
                    and batch <= MLA_EARLY_KV_MAX_ROWS)
    if block_n is None:
        # Held across the wait, a 16-bit pool's 32-key block spills on sm_90 at 4 warps (24 bytes).
        block_n = 16 if early_kv and not fp8 else 32
    if num_warps is None:
        # 4 warps spill registers on sm_90 widening to f16 (68-76 bytes) or with Triton's cvt.
        num_warps = 8 if fp8 and widen != "words" else 4
    _mla_decode_split_kernel[(batch, triton.cdiv(num_heads, block_h), num_kv_splits)](
        q, kv_buffer, req_to_token, req_pool_indices, seq_lens, dest, part_lse,
        sm_scale * kv_scale, logit_cap, float(kv_scale), num_kv_splits,
        q.stride(0), q.stride(1), kv_buffer.stride(0), req_to_token.stride(0),
        *dest_strides, part_lse.stride(0), part_lse.stride(1),
        NUM_HEADS=num_heads, BLOCK_H=max(16, block_h), BLOCK_N=block_n,
        LORA=kv_lora_rank, ROPE=rope, BLOCK_C=block_size(kv_lora_rank), BLOCK_R=block_size(rope),
        HAS_CAP=logit_cap > 0, DOT_PRECISION=dot_precision(q.dtype), DIRECT=direct,
        WIDEN=_WIDEN[widen], SLOTS_AHEAD=slots_ahead, PDL=pdl, EARLY_KV=early_kv,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
    if direct:
        return
    _decode_merge_kernel[(batch, num_heads)](
        part_out, part_lse, out, num_kv_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        V_DIM=kv_lora_rank, BLOCK_DV=block_size(kv_lora_rank),
        BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)), PDL=pdl, num_warps=4, launch_pdl=pdl,
    )


@triton.jit
def _mla_extend_kernel(
    Q, K_New, Out, KV, Req_To_Token, Req_Pool_Indices, Prefix_Lens, Extend_Lens, Extend_Start,
    Tree_Mask, Tree_Mask_Indptr,
    sm_scale, logit_cap, out_scale,
    stride_qt, stride_qh, stride_knt, stride_ot, stride_oh, stride_kvt, stride_r2t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr, TREE_MASK: tl.constexpr,
):
    head = tl.program_id(0)
    m_start = tl.program_id(1) * BLOCK_M
    row = tl.program_id(2).to(tl.int64)
    ext_len = tl.load(Extend_Lens + row).to(tl.int32)
    if m_start >= ext_len:  # the grid covers the longest row
        return
    prefix_len = tl.load(Prefix_Lens + row).to(tl.int32)
    tok0 = tl.load(Extend_Start + row).to(tl.int64)
    req = tl.load(Req_Pool_Indices + row).to(tl.int64)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < LORA
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE
    q_rows = Q + (tok0 + offs_m)[:, None] * stride_qt + head * stride_qh
    q_c = tl.load(q_rows + offs_c[None, :], mask=mask_m[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_rows + LORA + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)

    # 1. The cached prefix, gathered from the pool: visible to every new token.
    token_row = Req_To_Token + req * stride_r2t
    for start in range(0, prefix_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        loc = tl.load(token_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        c, r = _load_kv(KV, loc, stride_kvt, mask_n, offs_c, mask_c, offs_r, mask_r, LORA, ROPE, q_c.dtype)
        m_i, l_i, acc = _mla_fold(q_c, q_r, c, r, mask_n[None, :], m_i, l_i, acc, sm_scale, logit_cap,
                                  HAS_CAP, DOT_PRECISION)

    # 2. The new tokens, causal; the loop stops at the block's last query.
    hi = tl.minimum(ext_len, m_start + BLOCK_M)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        c, r = _load_kv(K_New, tok0 + offs_n, stride_knt, mask_n, offs_c, mask_c, offs_r, mask_r, LORA, ROPE,
                        q_c.dtype)
        keep = mask_n[None, :] & (offs_m[:, None] >= offs_n[None, :])
        if TREE_MASK:
            tree0 = tl.load(Tree_Mask_Indptr + row).to(tl.int64)
            allowed = tl.load(Tree_Mask + tree0 + offs_m[:, None] * ext_len + offs_n[None, :],
                              mask=mask_m[:, None] & mask_n[None, :], other=0)
            keep = keep & (allowed != 0)
        m_i, l_i, acc = _mla_fold(q_c, q_r, c, r, keep, m_i, l_i, acc, sm_scale, logit_cap,
                                  HAS_CAP, DOT_PRECISION)

    # Every live query sees at least itself, so l_i > 0 on the rows stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * out_scale
    tl.store(Out + (tok0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_c[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


def default_mla_extend_config(dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)``: a ``[BLOCK_M, 512]`` float32 accumulator and
    ``[BLOCK_N, 512]`` latent tiles keep the blocks small. For sm_90 at 512 + 64 dims, ptxas spills
    none of them at 8 warps with (32, 32) tiles over a 16-bit pool and (16, 32) over an fp8 one
    (widening fp8 takes registers); 4 warps, or 64-row tiles, spill."""
    if dtype == torch.float32:
        return 16, 16, 4, 1
    if kv_dtype.itemsize == 1:
        return 16, 32, 8, 2
    return 32, 32, 8, 2


def mla_extend_fwd(
    q: torch.Tensor, k_new: torch.Tensor, out: torch.Tensor, kv_buffer: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor, extend_start_loc: torch.Tensor, max_extend_len: int,
    sm_scale: float, kv_lora_rank: int, logit_cap: float = 0.0, *, kv_scale: float = 1.0,
    config: tuple[int, int, int, int] | None = None,
    tree_mask: torch.Tensor | None = None, tree_mask_indptr: torch.Tensor | None = None,
) -> None:
    """Causal attention of each row's new tokens (``q`` ``[tokens, num_heads, lora + rope]``, their
    latent+rope keys ``k_new`` ``[tokens, 1, lora + rope]``) over the row's cached prefix in the MLA
    pool and themselves, into ``out`` ``[tokens, num_heads, lora]``. The row arguments, ``config``
    and the tree mask are those of ``extend_attention_fwd``; ``kv_scale``: an fp8 pool's scale
    (``k_new`` then read back from the pool, as stored)."""
    check_kernel_dtype(q.dtype, "q")
    num_tokens, num_heads, head_dim = q.shape
    _check_mla_shapes(q, kv_buffer, kv_lora_rank, "extend")
    _check_mla_shapes(q, k_new, kv_lora_rank, "extend (k_new)")
    if out.stride(-1) != 1:
        raise ValueError("mla extend: out needs a contiguous last dim")
    batch = extend_seq_lens.shape[0]
    if batch == 0 or num_tokens == 0 or max_extend_len <= 0:
        return
    block_m, block_n, num_warps, num_stages = config or default_mla_extend_config(q.dtype, kv_buffer.dtype)
    has_tree = tree_mask is not None
    if has_tree:
        if tree_mask_indptr is None:
            raise ValueError("mla extend: tree_mask needs tree_mask_indptr")
        tree_mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    else:
        tree_mask = tree_mask_indptr = extend_seq_lens  # unused pointers
    rope = head_dim - kv_lora_rank
    _mla_extend_kernel[(num_heads, triton.cdiv(max_extend_len, block_m), batch)](
        q, k_new, out, kv_buffer, req_to_token, req_pool_indices, prefix_lens, extend_seq_lens,
        extend_start_loc, tree_mask, tree_mask_indptr,
        sm_scale * kv_scale, logit_cap, float(kv_scale),
        q.stride(0), q.stride(1), k_new.stride(0), out.stride(0), out.stride(1),
        kv_buffer.stride(0), req_to_token.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, LORA=kv_lora_rank, ROPE=rope,
        BLOCK_C=block_size(kv_lora_rank), BLOCK_R=block_size(rope),
        HAS_CAP=logit_cap > 0, DOT_PRECISION=dot_precision(q.dtype), TREE_MASK=has_tree,
        num_warps=num_warps, num_stages=num_stages,
    )


def _check_mla_shapes(q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int, what: str) -> None:
    head_dim = q.shape[2]
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != head_dim:
        raise ValueError(
            f"mla {what}: the KV tensor has shape {tuple(kv.shape)}; accepted: [slots, 1, {head_dim}] "
            f"(one latent+rope row per token, the width of q)"
        )
    if not 0 < kv_lora_rank < head_dim:
        raise ValueError(f"mla {what}: kv_lora_rank={kv_lora_rank}; accepted: 1..{head_dim - 1}")
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError(f"mla {what}: q and the KV tensor need a contiguous last dim")


__all__ = ["MLA_DECODE_BLOCK_H", "MLA_EARLY_KV_MAX_ROWS", "default_mla_extend_config", "mla_decode_fwd",
           "mla_extend_fwd", "mla_head_blocks"]
