"""Stage 1 of split-KV decode over an e4m3 pool on the fp8 tensor cores (Hopper wgmma).

The widening kernels (``decode_attention._decode_split_kernel``) turn every gathered e4m3 key
and value into a 16-bit number before the dot: a conversion per pair of values plus the byte
shuffles that put them into the tensor-core operand layout, per key and KV head 256 values, so at
large batches they run at ~0.65 of the KV-read bound while the 16-bit pool's kernel reaches 0.97.

Here the keys go to the tensor cores as stored. Hopper's fp8 ``wgmma`` needs 64 rows on its M
side and both operands K-major, so the scores are computed transposed, ``s^T = K q^T``: the block
of ``BLOCK_N`` keys (64) is M, the group's query heads (padded to 16) are N, the head dim is the
reduction; K's rows are head-dim-contiguous, as are q's. q is bf16, so it is split into two e4m3
terms (``jit_math.q_to_e4m3_pair``: ``q = row * (16 hi + lo)``, within about 2^-8
of the row's largest component, where the e4m3 keys themselves hold 2^-4): two fp8 dots.

P times V (``PV``, ``decode_attention_fwd``'s ``fp8_mma`` minus one):

- 0: V widened to float16 and multiplied by P (float16, query heads as M) on ``mma.sync``, as the
  widening kernel does;
- 1: on the fp8 tensor cores too, transposed, ``o^T = V^T p^T`` (V's head dim as M, the keys as the
  reduction), P (at most 1) as two e4m3 terms (``p = (16 hi + lo) / 4096``, ``hi = e4m3(256 p)``);
  V's rows are not K-major for it, so Triton transposes the tile on its way to the tensor cores;
- 2: transposed too, V widened to float16 (16-bit wgmma operands may be MN-major).

One program per (KV head, row, split), a row's KV heads consecutive; no logit cap and no sliding
window. ``decode_attention_fwd`` runs it only when asked (``fp8_mma``): on an H200 it is slower
than the widening kernel at every batch measured (``benchmarks/bench_decode.py --fp8-mma``,
Llama-3-8B heads, 1,536-token rows; batch 1,024: mode 1 1,176 us, 3 1,540 us, 2 2,562 us against
1,118 us; batch 256: 316 / 416 / 667 against 292 us; batch 64: 93 / 121 / 182 against 90 us). Taking
the conversion of K off the widening path (mode 1) did not speed it up, so the conversions are not
what holds the fp8 decode at ~0.67 of the KV-read bound.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_attention_triton.jit_math import q_to_e4m3_pair, to_e4m3


@triton.jit
def _decode_fp8_split_kernel(
    Q, K_Buf, V_Buf, Req_To_Token, Req_Pool_Indices, Seq_Lens, Part_Out, Part_Lse,
    sm_scale, v_scale, num_kv_splits,
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
    DIRECT: tl.constexpr,
    PDL: tl.constexpr,
    PV: tl.constexpr,
    UPCAST: tl.constexpr,
):
    kv_head = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    if PDL:
        # Launched with programmatic dependent launch: let the merge start, and read nothing the
        # previous kernels write (q, the newest K/V) before they are done.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq_len = tl.load(Seq_Lens + row).to(tl.int32)
    req = tl.load(Req_Pool_Indices + row).to(tl.int64)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, V_DIM)
    q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    q_hi, q_lo, q_row = q_to_e4m3_pair(q, UPCAST)
    q_hi_t = tl.trans(q_hi)
    q_lo_t = tl.trans(q_lo)
    # Per query head (a column of the transposed scores): its row factor, the softmax scale, log2(e).
    col_scale = q_row * (sm_scale * 1.4426950408889634)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if PV > 0:  # transposed: o^T = V^T p^T
        acc = tl.zeros([V_DIM, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, V_DIM], tl.float32)
    token_row = Req_To_Token + req * stride_r2t
    k_base = K_Buf + kv_head * stride_kh + offs_d[None, :]
    v_base = V_Buf + kv_head * stride_vh + offs_dv[None, :]
    # Each block's slots are loaded one block ahead (see the widening kernel's slots-ahead loop):
    # the gathers' addresses are then known when the block starts and the pipeliner overlaps them.
    offs_nx = lo + tl.arange(0, BLOCK_N)
    loc_nx = tl.load(token_row + offs_nx, mask=offs_nx < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        loc = loc_nx.to(tl.int64)
        offs_nx = offs_n + BLOCK_N
        loc_nx = tl.load(token_row + offs_nx, mask=offs_nx < hi, other=0)
        k = tl.load(k_base + loc[:, None] * stride_kt, mask=mask_n[:, None], other=0.0)
        v = tl.load(v_base + loc[:, None] * stride_vt, mask=mask_n[:, None], other=0.0)
        if UPCAST:  # Triton's interpreter: fp8 tiles are float32 ones (to_e4m3), the dots exact in float32
            kf = k.to(tl.float32)
            s = tl.dot(kf, q_lo_t.to(tl.float32), tl.dot(kf, q_hi_t.to(tl.float32), input_precision="ieee") * 16.0,
                       input_precision="ieee")
        else:
            s = tl.dot(k, q_lo_t, tl.dot(k, q_hi_t) * 16.0)
        s = tl.where(mask_n[:, None], s * col_scale[None, :], float("-inf"))  # [BLOCK_N, BLOCK_H]
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        if PV == 2:
            # o^T = V^T p^T in float16 on wgmma (V^T, 128 rows, as M; float16 operands may be MN-major).
            if UPCAST:
                pv = tl.dot(tl.trans(v.to(tl.float32)), p, input_precision="ieee")
            else:
                pv = tl.dot(tl.trans(v.to(tl.float16)), p.to(tl.float16))
            acc = acc * alpha[None, :] + pv  # [V_DIM, BLOCK_H]
        elif PV == 1:
            ps = p * 256.0
            p_hi = to_e4m3(ps, UPCAST)
            p_lo = to_e4m3((ps - p_hi.to(tl.float32)) * 16.0, UPCAST)
            vt = tl.trans(v)
            if UPCAST:
                vf = vt.to(tl.float32)
                pv = tl.dot(vf, p_lo.to(tl.float32), tl.dot(vf, p_hi.to(tl.float32), input_precision="ieee") * 16.0,
                            input_precision="ieee")
            else:
                pv = tl.dot(vt, p_lo, tl.dot(vt, p_hi) * 16.0)
            acc = acc * alpha[None, :] + pv * (1.0 / 4096.0)  # [V_DIM, BLOCK_H]
        else:
            if UPCAST:
                pv = tl.dot(tl.trans(p), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(tl.trans(p).to(tl.float16), v.to(tl.float16))
            acc = acc * alpha[:, None] + pv  # [BLOCK_H, V_DIM]
        m_i = m_new

    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    out_base = Part_Out + row * stride_pob + split * stride_pos
    if PV > 0:
        out = tl.trans(acc) / l_safe[:, None] * v_scale
    else:
        out = acc / l_safe[:, None] * v_scale
    tl.store(out_base + heads[:, None] * stride_poh + offs_dv[None, :], out.to(Part_Out.dtype.element_ty),
             mask=mask_h[:, None])
    if not DIRECT:
        tl.store(Part_Lse + row * stride_plb + heads * stride_plh + split, lse, mask=mask_h)
