"""Split-KV ("flash-decoding") attention for one query token per row over the paged pool.

Stage 1 launches one program per (row, KV head, split). It loads the query heads that
share the KV head (the GQA group) as one ``[BLOCK_H, head_dim]`` tile, so every K/V
row is read from memory once for the whole group, and walks its share of the
sequence in ``BLOCK_N`` blocks with an online softmax. It writes the split's
normalised partial output and its log-sum-exp (base 2) to a float32 workspace.
Stage 2 launches one program per (row, query head) and merges the splits:
``out = sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m)``.

Splitting the sequence is what lets batch 1 or a handful of long rows fill the
GPU: without it there are only ``batch * num_kv_heads`` programs (8 for Llama-3-8B
at batch 1) against 132 SMs. Each row divides its own length by the split count
(rounded up to whole blocks), so one split count works for every row and for
every replay of a CUDA graph; splits past a short row's end are empty and write
``lse = -inf``, which stage 2 weighs as zero. With a single split (batches large
enough to fill the GPU on their own) stage 1 writes the output directly and stage 2
is skipped.

Stage 1 has two loops (``decode_tiles`` picks one by the split count). The plain loop loads a
block's slots and then its K/V. The slots-ahead loop loads each block's slots one block early,
so the K/V addresses are known when the block starts and Triton's pipeliner double-buffers the
gathers (async copies); it wins where programs walk long sequences (few splits, large batches).
An e4m3 pool under bf16 queries is gathered as int32 words and widened by ``jit_math.widen_e4m3_words``,
or, at few splits on sm_89+, widened to float16 by the hardware conversion (``widen_e4m3_words_f16``)
with q in float16. At one split such a pool goes to ``decode_fp8_mma`` instead (Gluon: the widened words
are the tensor-core operands where they were gathered; ``DecodeTiles.mma_block_n``).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.platforms import device_index
from engine_attention_triton.jit_math import (
    base2_scores,
    block_size,
    check_kernel_dtype,
    dot_precision,
    gathers_words,
    widen,
)

try:  # Gluon (Triton 3.5+); without it the Triton kernel runs at every batch
    from engine_attention_triton import decode_fp8_mma
except ImportError as exc:
    if not (exc.name or "").startswith("triton"):  # only Triton's Gluon modules may be missing
        raise
    decode_fp8_mma = None

#: A split shorter than this costs more in workspace traffic and merging than it saves.
#: (H100, Llama-3-8B heads, batch 1, 1k context, in a CUDA graph: 16 splits of 64
#: tokens ran in 7.9 us, 8 splits in 8.9 us, 4 in 12.9 us.)
MIN_TOKENS_PER_SPLIT = 64
#: Programs per SM stage 1 aims for: enough to hide the latency of the gathered loads.
TARGET_PROGRAMS_PER_SM = 4
#: Stage 1's launch order: a row's KV heads as consecutive programs (True) or each head's rows.
HEADS_INNER = False
#: KV heads one stage-1 program attends where the shapes allow (``kv_heads_per_program``).
KV_PER_PROGRAM = 1
#: Stage-1 programs of one split from which an e4m3 pool under bf16 queries takes one-warp, 16-key
#: tiles (``decode_tiles``; measured faster at 3,072 to 8,192 programs, not at 2,048).
ONE_WARP_PROGRAMS = 3072
#: An e4m3 pool under bf16 queries at one split runs ``decode_fp8_mma`` (operands widened in registers, no
#: trip through shared memory) where its shapes fit (``DecodeTiles.mma_block_n``); False: never.
MMA_IN_REGISTERS = True
#: Stage-1 programs from which ``decode_fp8_mma`` takes 16-key blocks (under a register cap: 16 programs an
#: SM) instead of 32-key ones (9 an SM, twice the bytes in flight each); see ``decode_tiles``.
MMA_16_KEY_PROGRAMS = 4096


def kv_heads_per_program(num_kv_heads: int, head_dim: int, v_dim: int, wanted: int | None = None,
                         default: int = KV_PER_PROGRAM) -> int:
    """KV heads per stage-1 program: ``wanted`` (else ``default``) where it is a power of two
    dividing ``num_kv_heads`` and both head dims are powers of two; 1 where the default does not
    fit, and an explicit ``wanted`` that does not fit is an error."""
    per = default if wanted is None else wanted
    fits = (per >= 1 and per & (per - 1) == 0 and num_kv_heads % per == 0
            and head_dim & (head_dim - 1) == 0 and v_dim & (v_dim - 1) == 0)
    if fits:
        return per
    if wanted is None:
        return 1
    raise ValueError(f"decode attention: kv_per_program={wanted}; accepted: a power of two dividing "
                     f"num_kv_heads={num_kv_heads}, with power-of-two head dims (got {head_dim}, {v_dim})")


@triton.jit
def _attend_block(q, k, v, mask_n, m_i, l_i, acc, sm_scale, logit_cap, HAS_CAP: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, WORDS: tl.constexpr):
    """One block of keys (``mask_n``: the live ones, at least one) into the online softmax state.

    ``k`` and ``v`` are the gathered tiles as loaded (``WORDS`` 1: int32 words of four e4m3 values;
    2: e4m3 values and ``q`` in float16, which they widen to with one conversion per pair; 3: int32
    words widened to float16 with one conversion per pair, in inline PTX, and ``q`` in float16).
    """
    # An fp8 pool widens exactly to q's dtype; its k_scale is folded into sm_scale.
    qk = tl.dot(q, tl.trans(widen(k, q.dtype, WORDS)), input_precision=DOT_PRECISION)
    qk = base2_scores(qk, sm_scale, logit_cap, HAS_CAP)
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    v = widen(v, q.dtype, WORDS)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _q_to_f16(q):
    """q (bf16) in float16 for the ``WORDS`` 2 and 3 paths, and the factor its scores must be multiplied by.

    float16 holds every bf16 value of magnitude below 65504 exactly (more mantissa, less range); a
    tile holding a larger one is scaled by 2^-16 first (exact but for components under 2^-8, there
    far below the tile's largest) and its scores by 2^16.
    """
    qf = q.to(tl.float32)
    fac = tl.where(tl.max(tl.max(tl.abs(qf), 1), 0) > 32768.0, 65536.0, 1.0)
    return (qf / fac).to(tl.float16), fac


@triton.jit
def _decode_split_kernel(
    Q, K_Buf, V_Buf, Req_To_Token, Req_Pool_Indices, Seq_Lens, Part_Out, Part_Lse,
    sm_scale, logit_cap, v_scale, num_kv_splits,
    stride_qb, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_r2t,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr,
    SLOTS_AHEAD: tl.constexpr,
    WORDS: tl.constexpr,
    HEADS_INNER: tl.constexpr,
    KV_PER_PROGRAM: tl.constexpr,
):
    # DIRECT (one split): Part_Out is the output itself; no log-sum-exp, no merge pass.
    # PDL: launched with programmatic dependent launch. Until gdc_wait the program reads only what
    # earlier kernels than the previous one wrote (lengths, slots, and the K/V of every position
    # but the newest, which the previous kernel, the attention prologue, may be storing), so its
    # first block's gathers are in flight while that kernel drains. It lets the next kernels
    # launch at once: the merge reads nothing before its own wait, and the output projection
    # after it only weights, which it then streams during this kernel and the merge.
    # HEADS_INNER: the KV heads of a row are consecutive programs, so they run together and read
    # each token's K/V rows (adjacent in the pool) at about the same time.
    # KV_PER_PROGRAM (P) KV heads per program: a token's P K/V rows are one contiguous gather of
    # P * HEAD_DIM values, and the tiles are block-diagonal: query row r (head r // GROUP of the P)
    # holds q in that head's HEAD_DIM columns and zeros elsewhere, so one dot over all P * HEAD_DIM
    # columns gives each row its own head's scores, and row r's output is its head's columns of acc.
    if HEADS_INNER:
        kv_group = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
        kv_group = tl.program_id(1)
    kv_head = kv_group * KV_PER_PROGRAM
    split = tl.program_id(2)

    seq_len = tl.load(Seq_Lens + row).to(tl.int32)
    req = tl.load(Req_Pool_Indices + row).to(tl.int64)
    # The query sits at position seq_len - 1; a window of W sees positions >= seq_len - 1 - W.
    kv_lo = 0
    if SLIDING_WINDOW >= 0:
        kv_lo = tl.maximum(seq_len - 1 - SLIDING_WINDOW, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_lo, num_kv_splits), BLOCK_N) * BLOCK_N
    lo = kv_lo + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g
    mask_h = offs_g < GROUP * KV_PER_PROGRAM
    row_head = offs_g // GROUP  # which of the program's KV heads a query row reads
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM * KV_PER_PROGRAM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_DIM * KV_PER_PROGRAM

    q_ptrs = Q + row * stride_qb + heads[:, None] * stride_qh + (offs_d % HEAD_DIM)[None, :]
    q_mask = mask_h[:, None] & mask_d[None, :] & ((offs_d // HEAD_DIM)[None, :] == row_head[:, None])
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    token_row = Req_To_Token + req * stride_r2t
    if WORDS == 1 or WORDS == 3:
        # The fp8 pool gathered as int32 words of four values (strides in bytes are multiples of 4).
        offs_kc = tl.arange(0, BLOCK_D // 4)
        mask_kc = offs_kc < HEAD_DIM // 4 * KV_PER_PROGRAM
        offs_vc = tl.arange(0, BLOCK_DV // 4)
        mask_vc = offs_vc < V_DIM // 4 * KV_PER_PROGRAM
        k_cols = offs_kc // (HEAD_DIM // 4) * (stride_kh // 4) + offs_kc % (HEAD_DIM // 4)
        v_cols = offs_vc // (V_DIM // 4) * (stride_vh // 4) + offs_vc % (V_DIM // 4)
        k_base = (K_Buf + kv_head * stride_kh).to(tl.pointer_type(tl.int32), bitcast=True) + k_cols[None, :]
        v_base = (V_Buf + kv_head * stride_vh).to(tl.pointer_type(tl.int32), bitcast=True) + v_cols[None, :]
        kt = stride_kt // 4
        vt = stride_vt // 4
    else:
        offs_kc = offs_d
        mask_kc = mask_d
        offs_vc = offs_dv
        mask_vc = mask_dv
        k_cols = offs_d // HEAD_DIM * stride_kh + offs_d % HEAD_DIM
        v_cols = offs_dv // V_DIM * stride_vh + offs_dv % V_DIM
        k_base = K_Buf + kv_head * stride_kh + k_cols[None, :]
        v_base = V_Buf + kv_head * stride_vh + v_cols[None, :]
        kt = stride_kt
        vt = stride_vt
    first = lo
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # The first block, the newest position left out, then that position after the wait.
        offs_n = lo + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        loc = tl.load(token_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        old = mask_n & (offs_n < seq_len - 1)
        k_old = tl.load(k_base + loc[:, None] * kt, mask=old[:, None] & mask_kc[None, :], other=0.0)
        v_old = tl.load(v_base + loc[:, None] * vt, mask=old[:, None] & mask_vc[None, :], other=0.0)
        tl.extra.cuda.gdc_wait()
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        if WORDS >= 2:
            q, q_fac = _q_to_f16(q)
            sm_scale = sm_scale * q_fac
        new = mask_n & (offs_n == seq_len - 1)
        k_new = tl.load(k_base + loc[:, None] * kt, mask=new[:, None] & mask_kc[None, :], other=0.0)
        v_new = tl.load(v_base + loc[:, None] * vt, mask=new[:, None] & mask_vc[None, :], other=0.0)
        if lo < hi:
            m_i, l_i, acc = _attend_block(q, tl.where(new[:, None], k_new, k_old), tl.where(new[:, None], v_new, v_old),
                                          mask_n, m_i, l_i, acc, sm_scale, logit_cap, HAS_CAP, DOT_PRECISION, WORDS)
        first = lo + BLOCK_N
    else:
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        if WORDS >= 2:
            q, q_fac = _q_to_f16(q)
            sm_scale = sm_scale * q_fac

    # Every block starts below hi, so it holds at least one live key and m_new stays finite.
    if SLOTS_AHEAD:
        # Each block's slots are loaded one block ahead, so its K/V addresses are known when the
        # block starts: Triton's pipeliner then keeps NUM_STAGES - 1 blocks of K/V in flight
        # (async copies into shared memory) while the current one is attended. Loading the slots
        # in the same block makes the gathers wait on them, and the pipeliner keeps one buffer.
        offs_nx = first + tl.arange(0, BLOCK_N)
        loc_nx = tl.load(token_row + offs_nx, mask=offs_nx < hi, other=0)
        for start in range(first, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            loc = loc_nx.to(tl.int64)
            offs_nx = offs_n + BLOCK_N
            loc_nx = tl.load(token_row + offs_nx, mask=offs_nx < hi, other=0)
            k = tl.load(k_base + loc[:, None] * kt, mask=mask_n[:, None] & mask_kc[None, :], other=0.0)
            v = tl.load(v_base + loc[:, None] * vt, mask=mask_n[:, None] & mask_vc[None, :], other=0.0)
            m_i, l_i, acc = _attend_block(q, k, v, mask_n, m_i, l_i, acc, sm_scale, logit_cap, HAS_CAP,
                                          DOT_PRECISION, WORDS)
    else:
        for start in range(first, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            loc = tl.load(token_row + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(k_base + loc[:, None] * kt, mask=mask_n[:, None] & mask_kc[None, :], other=0.0)
            v = tl.load(v_base + loc[:, None] * vt, mask=mask_n[:, None] & mask_vc[None, :], other=0.0)
            m_i, l_i, acc = _attend_block(q, k, v, mask_n, m_i, l_i, acc, sm_scale, logit_cap, HAS_CAP,
                                          DOT_PRECISION, WORDS)

    # An empty split (past the row's end) writes zeros and lse = -inf: weight zero in stage 2.
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    out_base = Part_Out + row * stride_pob + split * stride_pos
    # v_scale (an fp8 pool's; 1.0 otherwise, an exact no-op) is linear: stage 2's merge keeps it.
    tl.store(
        out_base + heads[:, None] * stride_poh + (offs_dv % V_DIM)[None, :],
        (acc / l_safe[:, None] * v_scale).to(Part_Out.dtype.element_ty),
        mask=mask_h[:, None] & mask_dv[None, :] & ((offs_dv // V_DIM)[None, :] == row_head[:, None]),
    )
    if not DIRECT:
        tl.store(Part_Lse + row * stride_plb + heads * stride_plh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    Part_Out, Part_Lse, Out,
    num_kv_splits,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    stride_ob, stride_oh,
    V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        # Launched with PDL after stage 1 (which triggers at its start). The output projection next
        # (a skinny GEMM launched with PDL) reads only its weights before it waits, so it may start
        # at once and stream them while stage 1 and this kernel run.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_kv_splits
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_DIM

    lse = tl.load(
        Part_Lse + row * stride_plb + head * stride_plh + offs_s, mask=mask_s, other=float("-inf")
    )
    # Split 0 always holds the row's first live block, so the maximum is finite.
    weight = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(
        Part_Out + row * stride_pob + head * stride_poh
        + offs_s[:, None] * stride_pos + offs_dv[None, :],
        mask=mask_s[:, None] & mask_dv[None, :],
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        Out + row * stride_ob + head * stride_oh + offs_dv,
        out.to(Out.dtype.element_ty),
        mask=mask_dv,
    )


def choose_num_kv_splits(
    batch_size: int,
    num_kv_heads: int,
    num_sms: int,
    max_kv_splits: int,
    max_seq_len: int | None = None,
) -> int:
    """How many sequence splits stage 1 should use for a decode batch.

    Aims at ``TARGET_PROGRAMS_PER_SM`` programs per SM, never below one split
    nor above ``max_kv_splits``; with ``max_seq_len`` known (eager mode) it also
    keeps every split at least ``MIN_TOKENS_PER_SPLIT`` long. CUDA graphs pass
    ``max_seq_len=None`` so the count depends on the batch size alone and stays
    valid for every replay.
    """
    programs = max(1, batch_size * num_kv_heads)
    splits = triton.cdiv(num_sms * TARGET_PROGRAMS_PER_SM, programs)
    if max_seq_len is not None:
        splits = min(splits, triton.cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT))
    return max(1, min(splits, max_kv_splits))


class DecodeTiles(NamedTuple):
    slots_ahead: bool
    block_n: int
    num_warps: int
    num_stages: int
    heads_inner: bool = HEADS_INNER
    kv_per_program: int = KV_PER_PROGRAM
    #: An e4m3 pool under bf16 queries widens to float16 by the hardware's paired conversion
    #: (sm_89+; ``words`` 3 with one split, else 2) instead of to bf16 on the integer pipe
    #: (``widen_e4m3_words``).
    widen_f16: bool = False
    #: Keys a block of ``decode_fp8_mma`` (16 or 32), the one-split e4m3 kernel with its tensor-core
    #: operands built in registers, which runs instead where its shapes fit; 0: not that kernel.
    mma_block_n: int = 0


def decode_tiles(q_dtype: torch.dtype, head_dim: int, num_kv_splits: int, words: bool,
                 programs: int = 0) -> DecodeTiles:
    """Stage 1's tiles: by the split count and the ``programs`` a split (rows times KV heads), so by
    the batch size alone, as CUDA graphs need.

    Few splits (batch >= ~16 at 8 KV heads on 132 SMs) mean long loops per program: there the
    slots-ahead loop keeps ``num_stages - 1`` blocks in flight and small blocks keep more programs
    on each SM. On an H200 at Llama-3-8B heads and 1.5k tokens, batch 512, bf16 pool: 762 us with
    (32 keys, 4 warps, 4 stages) against 805 us with the plain loop's (64, 4, 3); fp8 words pool:
    599 us with (32, 2 warps, 3) against 710 us (``benchmarks/bench_decode.py --sweep``). Many
    splits (batch 1) cover ~100 keys each, where the plain loop's single (64, 4, 3) is as fast.

    At few splits an e4m3 pool widens to float16 by the hardware conversion (``widen_f16``), q in
    float16: on the H200 at batch 512 / 256 / 128, 583 / 296 / 154 us against 606 / 308 / 170 us
    for the integer-pipe widening to bf16 (``--tiles 1,32,2,3,2,1,1``). With one split it converts
    the words gathered, in inline PTX (``words`` 3): Triton's own conversion (``words`` 2) reads V's
    tensor-core operand from shared memory a byte at a time. At batch 1,024 (8,192 programs): 1,037 us
    against 1,123 us, and 953 us with one warp and 16 keys a block, which has the most programs
    resident on an SM (``benchmarks/bench_decode_variants.py``, where a copy of this loop that gathers
    and widens but does not attend takes 757 us, the KV-read bound 763 us); batch 768 / 512 / 384,
    677 / 458 / 347 us with one warp against 784 / 536 / 400 us with two (``bench_decode.py``); batch
    256, 279 us with one warp, 273-276 us with two, against 293 us for ``words`` 2. At two splits
    (batch 64) ``words`` 2 measured faster (128 against 141 us).
    The heads-inner launch order was neither faster nor slower at batch 512; neither was a row's slots
    being consecutive instead of shuffled, and several KV heads a program (``kv_per_program`` 2, 4, 8)
    was slower at every tile tried (645 us at best for 2 heads, 825 us for 4): the fp8 kernel's
    distance to the KV-read bound is not the gathers' access pattern. Neither did gathering the next
    block's K/V into registers instead of async copies help (1,306-1,608 us at batch 1,024), nor a
    register cap (Triton's ``maxnreg`` 96 / 128: 1,104 / 1,041 us at 2 warps, 1,007 us at 1 warp).

    With one split (``MMA_IN_REGISTERS``), ``mma_block_n`` sends the call to ``decode_fp8_mma`` where its
    shapes fit: it gathers the words straight into the tensor cores' operand layout, so the widened tiles
    skip the trip through shared memory. On the H200 at 1,552-token rows, batch 1,024 / 768 / 512 / 384 /
    256 / 128: 783 / 592 / 399 / 306 / 209 / 111 us, 0.97-0.85 of the KV-read bound, against 912 / 689 /
    466 / 356 us for the one-warp tiles and 280 / 178 us for the two-warp ones at 256 / 128
    (``bench_decode.py --mma``, one run). 16-key blocks from ``MMA_16_KEY_PROGRAMS`` programs (783 against
    790 us at batch 1,024 for 32-key ones, 399 against 403 at 512), 32-key ones below (306 against 339 us
    at 384, 111 against 137 at 128; 209 against 205 at 256).
    """
    if head_dim > 128 or q_dtype == torch.float32:
        return DecodeTiles(False, 32, 4, 3)
    if num_kv_splits > 4:
        return DecodeTiles(False, 64, 4, 3)
    if words:
        mma_block_n = 0
        if num_kv_splits == 1 and MMA_IN_REGISTERS and decode_fp8_mma is not None:
            mma_block_n = 16 if programs >= MMA_16_KEY_PROGRAMS else 32
        if num_kv_splits == 1 and programs >= ONE_WARP_PROGRAMS:
            return DecodeTiles(True, 16, 1, 3, heads_inner=True, widen_f16=True, mma_block_n=mma_block_n)
        return DecodeTiles(True, 32, 2, 3, heads_inner=True, widen_f16=True, mma_block_n=mma_block_n)
    return DecodeTiles(True, 32, 4, 4)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    num_kv_splits: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    sliding_window_size: int = -1,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    slots_ahead: bool | None = None,
    words: int | None = None,
    heads_inner: bool | None = None,
    kv_per_program: int | None = None,
    pdl: bool = False,
) -> None:
    """Decode attention of ``q`` over each row's whole sequence in the paged pool.

    Args:
        q: ``[batch, num_heads, head_dim]`` (the last dim contiguous).
        k_buffer, v_buffer: one layer's pool, ``[rows, num_kv_heads, head_dim|v_dim]``;
            the new token's K/V must already be saved there. q's dtype, or float8 (an fp8
            KV cache) holding ``k / k_scale`` and ``v / v_scale``.
        out: ``[batch, num_heads, v_dim]``, written in place.
        req_to_token: int32 ``[slots, max_context_len]``; ``req_pool_indices`` and
            ``seq_lens``: ``[batch]`` (any integer dtype).
        part_out, part_lse: float32 workspaces ``[>=batch, num_heads, >=num_kv_splits, v_dim]``
            and ``[>=batch, num_heads, >=num_kv_splits]``.
        num_kv_splits: splits per row (see ``choose_num_kv_splits``).
        sm_scale: softmax scale; ``logit_cap`` > 0 enables the tanh soft cap;
            ``sliding_window_size`` W >= 0 keeps keys at most W positions behind the query.
        k_scale, v_scale: an fp8 pool's per-tensor scales (the kernel reads ``stored * scale``).
        block_n, num_warps, num_stages, slots_ahead, words: overrides of ``decode_tiles`` and
            ``gathers_words`` (benchmarks and tests); ``words`` 2 widens an e4m3 pool to float16
            with the hardware conversion and attends with q in float16 (benchmarks); 3 does so on the
            pool gathered as words, the conversion in inline PTX (sm_89+).
        heads_inner: launch a row's KV heads as consecutive programs (default: ``decode_tiles``).
        kv_per_program: KV heads one stage-1 program attends (default: ``decode_tiles``, where the
            shapes allow; given, a power of two dividing the KV heads, over power-of-two head dims).
        pdl: launch both stages with programmatic dependent launch (sm_90+ CUDA only; see
            ``has_pdl``): stage 1 gathers its first block of keys and values, all but the newest
            position, while the previous kernel drains, and stage 2 lets the next kernel start.
    """
    check_kernel_dtype(q.dtype, "q")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    v_dim = v_buffer.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"decode attention: num_heads={num_heads} is not a multiple of "
            f"num_kv_heads={num_kv_heads}"
        )
    if num_kv_splits < 1 or num_kv_splits > part_lse.shape[2]:
        raise ValueError(
            f"decode attention: num_kv_splits={num_kv_splits}; the workspace holds "
            f"1..{part_lse.shape[2]}"
        )
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode attention: {name} needs a contiguous last dim")
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    chosen = words is None
    if chosen:
        words = int(gathers_words(q, k_buffer, v_buffer))
    elif words == 2 and not (k_buffer.dtype == v_buffer.dtype == torch.float8_e4m3fn and q.dtype != torch.float32):
        raise ValueError(f"decode attention: words=2 needs an e4m3 pool and 16-bit q, not {k_buffer.dtype} "
                         f"under {q.dtype}")
    elif words == 3 and not (gathers_words(q, k_buffer, v_buffer) and _sm89(device_index(q.device))):
        raise ValueError(f"decode attention: words=3 needs an e4m3 pool with 4-byte aligned rows under bf16 q on "
                         f"CUDA sm_89+, not {k_buffer.dtype} under {q.dtype} on {q.device}")
    elif words not in (0, 1, 2, 3):
        raise ValueError(f"decode attention: words={words}; accepted: 0, 1, 2, 3")
    tiles = decode_tiles(q.dtype, head_dim, num_kv_splits, bool(words), batch * num_kv_heads)
    # One split (large batches fill the GPU without splitting): stage 1 writes the output.
    direct = num_kv_splits == 1
    dest = out if direct else part_out
    dest_strides = (out.stride(0), out.stride(1), 0) if direct else (
        part_out.stride(0), part_out.stride(1), part_out.stride(2))
    if chosen and words == 1 and tiles.widen_f16 and _sm89(device_index(q.device)):
        words = 3 if num_kv_splits == 1 else 2
        if (words == 3 and tiles.mma_block_n and logit_cap <= 0 and decode_fp8_mma.fits(q, k_buffer, v_buffer)
                and all(t is None for t in (block_n, num_warps, num_stages, slots_ahead, heads_inner, kv_per_program))):
            decode_fp8_mma.decode_fp8_mma_fwd(q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, seq_lens,
                                              sm_scale, sliding_window_size, k_scale=k_scale, v_scale=v_scale,
                                              pdl=pdl, block_n=tiles.mma_block_n)
            return
    heads_inner = tiles.heads_inner if heads_inner is None else heads_inner
    # The tiles' choice falls back to one KV head a program where the shapes do not allow more.
    per_program = kv_heads_per_program(num_kv_heads, head_dim, v_dim, kv_per_program or None, tiles.kv_per_program)
    slots_ahead = tiles.slots_ahead if slots_ahead is None else slots_ahead
    block_n = block_n or tiles.block_n
    num_warps = num_warps or tiles.num_warps
    num_stages = num_stages or tiles.num_stages
    precision = dot_precision(q.dtype)
    kv_groups = num_kv_heads // per_program
    grid = (kv_groups, batch, num_kv_splits) if heads_inner else (batch, kv_groups, num_kv_splits)
    _decode_split_kernel[grid](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, dest, part_lse,
        sm_scale * k_scale, logit_cap, float(v_scale), num_kv_splits,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        *dest_strides,
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group,
        BLOCK_H=block_size(group * per_program),
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        V_DIM=v_dim,
        BLOCK_D=block_size(head_dim) * per_program,
        BLOCK_DV=block_size(v_dim) * per_program,
        SLIDING_WINDOW=sliding_window_size if sliding_window_size >= 0 else -1,
        HAS_CAP=logit_cap > 0,
        DOT_PRECISION=precision,
        DIRECT=direct,
        PDL=pdl,
        SLOTS_AHEAD=bool(slots_ahead),
        WORDS=int(words),
        HEADS_INNER=bool(heads_inner),
        KV_PER_PROGRAM=per_program,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    if not direct:
        _merge(part_out, part_lse, out, batch, num_heads, num_kv_splits, v_dim, pdl)


def _merge(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, batch: int, num_heads: int,
           num_kv_splits: int, v_dim: int, pdl: bool) -> None:
    _decode_merge_kernel[(batch, num_heads)](
        part_out, part_lse, out,
        num_kv_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        V_DIM=v_dim,
        BLOCK_DV=block_size(v_dim),
        BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)),
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )


@functools.cache
def _sm89(index: int) -> bool:
    """Whether the CUDA device converts e4m3 to float16 in hardware (sm_89+)."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


@functools.cache
def _has_pdl_index(index: int) -> bool:
    return os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.get_device_capability(index)[0] >= 9


def has_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` may use programmatic dependent launch (CUDA sm_90+, not under
    Triton's interpreter)."""
    if device.type != "cuda":
        return False
    return _has_pdl_index(device_index(device))


__all__ = ["DecodeTiles", "choose_num_kv_splits", "decode_attention_fwd", "decode_tiles", "gathers_words",
           "has_pdl", "kv_heads_per_program"]
