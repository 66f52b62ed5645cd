"""Triton kernels for ``KernelWeight`` (see ``layout``): ``y = x @ W.T + bias``.

Three paths, float32 accumulation, bf16/fp16 (or fp32) activations; ``choose_config`` picks by
the number of rows M (switch points measured on an H100: see ``GEMV_MAX_M`` and ``GEMM_MAX_M``):

- ``_gemv_kernel`` (decode, M = 1): one program per ``BLOCK_N`` output channels walking all of K;
  no split-K, a deterministic sum. The weight is stored output-major in plane order (``layout``),
  so a warp streams 1 KB of one row per step (16-byte loads) and bit slot i of a thread's words
  pairs with a contiguous run of activations: the activation loads get the weight tile's register
  layout and are shared by the 4 rows a thread holds; nothing crosses shared memory in the loop.
  A code becomes a float with one LOP3 (``code | exponent``, the float ``2**e + code``) and one
  FADD, never an int->float conversion (a quarter of the FMA rate on Hopper); per plane block
  (inside a group) the sum of ``code * x`` and the sum of x take the scale and zero once:
  ``s (sum q x - z sum x)``.
- ``_gemm_kernel`` (2 <= M <= ``GEMM_MAX_M``): fused dequantize-GEMM. Weight tiles are
  dequantized in registers (the same LOP3 trick, ``code - zero`` exact in bf16/fp16) and never
  written to memory; they are wgmma's register operand (``out^T = W x^T``), the activation tile
  its shared-memory operand, copied by cp.async over 3-4 pipeline stages; K is split over
  programs where the output tiles alone would leave SMs idle (``_splitk_reduce_kernel`` adds the
  float32 partials in a fixed order: deterministic).
- ``dequant`` (larger M): ``_dequant_kernel`` writes W in the activation dtype into a scratch
  ``[N, K]`` (size from the shape alone) and ``F.linear`` (cuBLAS) multiplies.

``K`` is a compile-time constant (a model has two or three): the loop bounds are known to the
compiler, and Triton 3.6's interpreter cannot loop over a run-time bound under numpy 2.4.

CUDA-graph safe: block sizes depend on shapes only (Python ints), no host syncs; allocations are
the output (and the split-K partials ``[split, M, N]`` float32; on the dequant path the scratch
weight; with ``x_f32`` a float32 copy of x).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine_quant_wna16.layout import KernelWeight, plane_words

from engine.platforms import device_index

# Triton 3.6's interpreter (CPU tests) computes 16-bit tl.dot wrongly: there the tiles are widened
# to float32 first (on a GPU that is the float32-activation path: exact IEEE products).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr,
                 M, N, K: tl.constexpr, stride_xm, stride_om, stride_qk, stride_qn,
                 BITS: tl.constexpr, GROUP: tl.constexpr, PLANE: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # A K tile is NG plane blocks of PLANE words (SUB = PACK * PLANE inputs, inside one group).
    PACK: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PACK // 2
    MASK: tl.constexpr = (1 << BITS) - 1
    SUB: tl.constexpr = PACK * PLANE
    NG: tl.constexpr = BLOCK_K // SUB
    NUM_WORDS: tl.constexpr = K // PACK
    pid_m = tl.program_id(0)  # rows fastest: the programs sharing a weight tile run together
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_g = tl.arange(0, NG)
    offs_j = tl.arange(0, PLANE)
    tile_w = offs_g[:, None] * PLANE + offs_j[None, :]  # [NG, PLANE]: word within the K tile
    # Weight tile [1, NG, BLOCK_N, PLANE]: with the blocks ahead of the output channels, Triton lays
    # threads along K (4 words each, then the blocks) and warps along N, so a warp reads contiguous
    # runs of a row. Bit slot i of the PLANE words of a block holds PLANE consecutive inputs, so the
    # activation tile of slot i is contiguous too; it is addressed with the weight's shape (stride 0
    # over N), which gives it the weight's layout: no data moves between layouts in the loop.
    w_ptrs = (qw_ptr + offs_n[None, None, :, None].to(tl.int64) * stride_qn
              + tile_w[None, :, None, :] * stride_qk)
    # Rows past M read row M - 1 (their results are not stored): the activation loads need no mask.
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None, None, None].to(tl.int64) * stride_xm
    no_n = tl.zeros((BLOCK_N,), dtype=tl.int32)[None, None, :, None]
    k_in = offs_g[:, None] * SUB + offs_j[None, :]  # [NG, PLANE]: input of slot 0
    offs_sub = offs_g[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [NG, SUB]: the blocks' inputs
    acc = tl.zeros((BLOCK_M, NG, BLOCK_N), dtype=tl.float32)  # per block; summed after the loop
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + (k0 // PACK) * stride_qk, mask=n_mask[None, None, :, None], other=0,
                        eviction_policy="evict_first")
        else:
            w_ok = (k0 // PACK + tile_w) < NUM_WORDS
            w = tl.load(w_ptrs + (k0 // PACK) * stride_qk,
                        mask=n_mask[None, None, :, None] & w_ok[None, :, None, :], other=0,
                        eviction_policy="evict_first")
        hi = w >> 16
        k_ok = (k0 + k_in) < K
        x_mask = m_mask[:, None, None, None] & k_ok[None, :, None, :]
        for i in tl.static_range(PACK):
            k = k0 + k_in + i * PLANE
            if HAS_PERM:
                k = tl.load(perm_ptr + k, mask=k_ok, other=0)
            if EVEN_K:
                xi = tl.load(x_rows + (k[None, :, None, :] + no_n)).to(tl.float32)
            else:
                xi = tl.load(x_rows + (k[None, :, None, :] + no_n), mask=x_mask, other=0.0).to(tl.float32)
            # Slot i sits at bits SHIFT = BITS * (i % HALF) of the low or high half-word. OR-ed into the
            # mantissa of 2**(23 - SHIFT) (exponent 150 - SHIFT), the float is 2**(23 - SHIFT) + code
            # exactly: one LOP3 and one FADD, no int->float conversion (a quarter of the FMA rate).
            if i < HALF:
                half = w
            else:
                half = hi
            if USE_ASM:  # one LOP3 (LLVM's and + or reach ptxas as two)
                bits = tl.inline_asm_elementwise(
                    "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                    [half, tl.full(half.shape, MASK << (BITS * (i % HALF)), tl.int32),
                     tl.full(half.shape, (150 - BITS * (i % HALF)) << 23, tl.int32)],
                    dtype=tl.int32, is_pure=True, pack=1)
            else:
                bits = (half & (MASK << (BITS * (i % HALF)))) | ((150 - BITS * (i % HALF)) << 23)
            f = bits.to(tl.float32, bitcast=True) - (1 << (23 - BITS * (i % HALF))) * 1.0
            if i == 0:
                t = f * xi
            else:
                t += f * xi
        part = tl.sum(t, axis=3)  # [BLOCK_M, NG, BLOCK_N]: sum of code * x per block
        # Sum of x per block, from one contiguous load of the tile's activations.
        ks = k0 + offs_sub
        sub_ok = ks < K
        if HAS_PERM:
            ks = tl.load(perm_ptr + ks, mask=sub_ok, other=0)
        xs = tl.load(x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm + ks[None, :, :],
                     mask=m_mask[:, None, None] & sub_ok[None, :, :], other=0.0).to(tl.float32)
        xg = tl.sum(xs, axis=2)[:, :, None]  # [BLOCK_M, NG, 1]
        g = (k0 + offs_g * SUB) // GROUP
        sz_off = g[:, None] * N + offs_n[None, :]
        sz_mask = (g < K // GROUP)[:, None] & n_mask[None, :]
        s = tl.load(s_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + sz_off, mask=sz_mask, other=0).to(tl.float32)
            acc += s[None, :, :] * (part - z[None, :, :] * xg)
        else:
            acc += s[None, :, :] * (part - (1 << (BITS - 1)) * xg)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K: tl.constexpr, stride_qk, stride_qn,
                    BITS: tl.constexpr, GROUP: tl.constexpr, PLANE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # W[n, k] = (code - zero) * scale in the output's dtype, W row-major [N, K] (for F.linear).
    # BLOCK_K is a multiple of PACK * PLANE: the tile holds whole plane blocks.
    PACK: tl.constexpr = 32 // BITS
    BW: tl.constexpr = BLOCK_K // PACK
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_k * BW + tl.arange(0, BW)
    mask = (offs_n < N)[:, None] & (offs_w < K // PACK)[None, :]
    w = tl.load(qw_ptr + offs_n[:, None].to(tl.int64) * stride_qn + offs_w[None, :] * stride_qk, mask=mask, other=0)
    shifts = tl.arange(0, PACK) * BITS
    q = ((w[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    k_first = (offs_w // PLANE) * (PACK * PLANE) + offs_w % PLANE  # input of each word's slot 0
    g = k_first // GROUP
    sz_off = g[None, :] * N + offs_n[:, None]
    s = tl.load(s_ptr + sz_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + sz_off, mask=mask, other=0).to(tl.float32)
    else:
        z = tl.full((BLOCK_N, BW), 1 << (BITS - 1), tl.float32)
    val = (q - z[:, :, None]) * s[:, :, None]
    k = k_first[None, :, None] + tl.arange(0, PACK)[None, None, :] * PLANE
    out = out_ptr + offs_n[:, None, None].to(tl.int64) * K + k
    tl.store(out, val.to(out_ptr.dtype.element_ty), mask=mask[:, :, None])


@triton.jit
def _slot_minus_zero(w, hi, i: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """Slot ``i`` of the words ``w`` (``hi = w >> 16``) as the float32 ``2**(23 - SHIFT) + code``
    (see ``_gemv_kernel``: the code ORed into the mantissa, one LOP3, no int->float conversion)."""
    HALF: tl.constexpr = 16 // BITS
    SHIFT: tl.constexpr = BITS * (i % HALF)
    if i < HALF:
        half = w
    else:
        half = hi
    if USE_ASM:
        bits = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
            [half, tl.full(half.shape, ((1 << BITS) - 1) << SHIFT, tl.int32),
             tl.full(half.shape, (150 - SHIFT) << 23, tl.int32)],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (half & (((1 << BITS) - 1) << SHIFT)) | ((150 - SHIFT) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant_tile(w, zc, s, BITS: tl.constexpr, SCALE_FIRST: tl.constexpr, USE_ASM: tl.constexpr,
                  DTYPE: tl.constexpr):
    """Words ``w [R, NB, LT]`` (``NB`` runs of ``LT`` plane words) -> ``[R, NB * PACK * LT]`` in
    ``DTYPE``, position ``(nb * PACK + i) * LT + j`` = slot ``i`` of word ``nb * LT + j``: in plane
    order that is input ``i * PLANE + j`` of run ``nb``'s block, so whole plane blocks come out in
    input order. Values: ``code - zero`` (exact in bf16/fp16), times ``s`` when ``SCALE_FIRST``;
    ``zc`` (the zero point) and ``s`` broadcast to ``w``."""
    hi = w >> 16
    HALF: tl.constexpr = 16 // BITS
    # Per slot: float32 (2**(23 - SHIFT) + code) - (2**(23 - SHIFT) + zero) = code - zero, exact.
    v0 = _slot_minus_zero(w, hi, 0, BITS, USE_ASM) - (zc + (1 << 23) * 1.0)
    v1 = _slot_minus_zero(w, hi, 1, BITS, USE_ASM) - (zc + (1 << (23 - BITS)) * 1.0)
    v2 = _slot_minus_zero(w, hi, 2, BITS, USE_ASM) - (zc + (1 << (23 - (2 % HALF) * BITS)) * 1.0)
    v3 = _slot_minus_zero(w, hi, 3, BITS, USE_ASM) - (zc + (1 << (23 - (3 % HALF) * BITS)) * 1.0)
    if SCALE_FIRST:
        v0, v1, v2, v3 = v0 * s, v1 * s, v2 * s, v3 * s
    if BITS == 4:
        v4 = _slot_minus_zero(w, hi, 4, BITS, USE_ASM) - (zc + (1 << 23) * 1.0)
        v5 = _slot_minus_zero(w, hi, 5, BITS, USE_ASM) - (zc + (1 << 19) * 1.0)
        v6 = _slot_minus_zero(w, hi, 6, BITS, USE_ASM) - (zc + (1 << 15) * 1.0)
        v7 = _slot_minus_zero(w, hi, 7, BITS, USE_ASM) - (zc + (1 << 11) * 1.0)
        if SCALE_FIRST:
            v4, v5, v6, v7 = v4 * s, v5 * s, v6 * s, v7 * s
        # tl.join appends an in-thread dim of 2 (the last, so the outermost join picks the slot's
        # lowest bit): [R, NB, LT, 2, 2, 2] holds slot 4a + 2b + c at [.., a, b, c].
        even = tl.join(tl.join(v0.to(DTYPE), v4.to(DTYPE)), tl.join(v2.to(DTYPE), v6.to(DTYPE)))
        odd = tl.join(tl.join(v1.to(DTYPE), v5.to(DTYPE)), tl.join(v3.to(DTYPE), v7.to(DTYPE)))
        t = tl.reshape(tl.join(even, odd), (w.shape[0], w.shape[1], w.shape[2], 8))
    else:
        t = tl.reshape(tl.join(tl.join(v0.to(DTYPE), v2.to(DTYPE)), tl.join(v1.to(DTYPE), v3.to(DTYPE))),
                       (w.shape[0], w.shape[1], w.shape[2], 4))
    # [R, NB, LT, PACK] -> [R, NB, PACK, LT]: a relabelling of each thread's registers (the
    # layout's dims are permuted), then the flattening is a relabelling too.
    t = tl.permute(t, (0, 1, 3, 2))
    return tl.reshape(t, (w.shape[0], w.shape[1] * w.shape[2] * (32 // BITS)))


@triton.jit
def _gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, part_ptr,
                 M, N, K: tl.constexpr, stride_xm, stride_om, stride_qk, stride_qn,
                 BITS: tl.constexpr, GROUP: tl.constexpr, PLANE: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOT_FP32: tl.constexpr, USE_ASM: tl.constexpr, SCALE_FIRST: tl.constexpr,
                 SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Fused dequantize-GEMM: ``tl.dot`` on K tiles whose weights are dequantized in registers.

    The weight tile ``[BLOCK_N, BLOCK_K / PACK]`` words is loaded output-major (contiguous runs
    of one channel's words) as ``NB`` runs of ``LT`` plane words and unpacked (``_dequant_tile``)
    so that whole plane blocks come out in input order: the activation tile is then one contiguous
    run per row (runs of ``LT`` at a stride of ``PLANE`` when a tile is part of a block), copied to
    shared memory as wgmma's operand without passing through registers. A K tile lies inside one
    group (``BLOCK_K <= GROUP``: one scale and zero per channel): the dot multiplies
    ``code - zero`` (exact in bf16/fp16) and the scale goes on its float32 partial product;
    ``SCALE_FIRST`` scales the weights before the dot instead (bf16 rounding of
    ``(code - zero) * scale``, as the dequantize path) so ``tl.dot`` accumulates in place, which
    Triton 3.6 compiles to one wait per wgmma (slower; kept as an option). Tiles over several
    groups were dropped: a per-word scale select passed the interpreter but failed on the H100
    (groups of 32, relative error > 1e-2).
    The product is ``out^T = W x^T``: the weight is the dot's left operand, so wgmma's 64-row side
    is the output channels and 16 activation rows take a 64 x 16 instruction, with no padding; the
    dequantized tile reaches wgmma from registers. (The ``x W^T`` form with 64-row activation
    tiles crashed Triton 3.6's compiler, OptimizeDotOperands, on sm90.)
    ``SPLIT_K`` > 1: program ``(tile, s)`` sums K ``[s * K_SPLIT, (s + 1) * K_SPLIT)`` into the
    float32 ``part [SPLIT_K, M, N]``; ``_splitk_reduce_kernel`` adds them in order.
    """
    PACK: tl.constexpr = 32 // BITS
    BW: tl.constexpr = BLOCK_K // PACK
    LT: tl.constexpr = PLANE if PLANE < BW else BW
    NB: tl.constexpr = BW // LT
    DTYPE: tl.constexpr = tl.float32 if DOT_FP32 else x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    # Neighbouring programs share a weight tile (same pid_n), so it is read from DRAM once.
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_nq = tl.where(n_mask, offs_n, 0).to(tl.int64)  # clamped: the weight loads need no mask
    # Word (nb, j) of a K tile is word nb * LT + j; slot i of a run holds LT consecutive inputs.
    word3 = tl.arange(0, NB)[:, None] * LT + tl.arange(0, LT)[None, :]  # [NB, LT]
    # Input of each tile position p = (nb * PACK + i) * LT + j: input nb * PACK * PLANE + i * PLANE + j,
    # which is p itself for whole plane blocks; inside one block, runs of LT at a stride of PLANE.
    p = tl.arange(0, BLOCK_K)
    if NB > 1:
        k_pos = p
    else:
        k_pos = tl.max_contiguous(tl.multiple_of((p // LT) * PLANE + p % LT, LT), LT)
    # Rows past M are masked (zero-filled, no memory request): clamping them to row M - 1 made all
    # programs hammer the same few L2 lines (the M = 2 GEMM ran 2.5x slower than M = 16).
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_ptrs = qw_ptr + offs_nq[:, None, None] * stride_qn + word3[None, :, :] * stride_qk  # [BLOCK_N, NB, LT]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    for kk in range(0, K_SPLIT, BLOCK_K):
        k0 = k_start + kk
        gw0 = k0 // PACK  # first word of the tile
        if NB > 1:  # whole plane blocks
            base = k0
        else:  # inside one block: its start plus the word offset
            base = tl.multiple_of((gw0 // PLANE) * (PACK * PLANE) + gw0 % PLANE, LT)
        src = base + k_pos
        if HAS_PERM:
            src = tl.load(perm_ptr + src)
        # [BLOCK_M, BLOCK_K], 2-D as loaded: it goes to shared memory as wgmma's operand directly.
        a = tl.load(x_rows + src[None, :], mask=m_mask[:, None], other=0.0).to(DTYPE)
        w = tl.load(w_ptrs + gw0 * stride_qk)
        g0 = k0 // GROUP
        s = tl.load(s_ptr + g0 * N + offs_nq)[:, None, None].to(tl.float32)
        if HAS_ZEROS:
            zc = tl.load(z_ptr + g0 * N + offs_nq)[:, None, None].to(tl.float32)
        else:
            zc = tl.full((BLOCK_N, 1, 1), 1 << (BITS - 1), tl.float32)
        b = _dequant_tile(w, zc, s, BITS, SCALE_FIRST, USE_ASM, DTYPE)  # [BLOCK_N, BLOCK_K]
        # out^T = W x^T: the weight tile is the left operand (wgmma's 64-row side, from registers).
        if SCALE_FIRST:
            if DOT_FP32:
                acc = tl.dot(b, tl.trans(a), acc, input_precision="ieee")
            else:
                acc = tl.dot(b, tl.trans(a), acc)
        else:
            if DOT_FP32:
                part = tl.dot(b, tl.trans(a), input_precision="ieee")
            else:
                part = tl.dot(b, tl.trans(a))
            acc += part * tl.reshape(s, (BLOCK_N, 1))
    acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part_out = part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(part_out, acc, mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr,
                          SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[m] = sum_s part[s, m] (+ bias)``, the splits added in order (deterministic)."""
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (split * M + m) * N + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@dataclass(frozen=True)
class KernelConfig:
    """Which kernel runs and its tile sizes.

    ``gemv``: ``block_m`` rows per program (the weight tile is read once for them);
    ``gemm``: ``tl.dot`` tiles; ``dequant``: the weight is dequantized to the activation dtype into
    a scratch ``[N, K]`` (``block_n`` x ``block_k`` per program) and ``F.linear`` (cuBLAS) runs.
    """

    kind: str  # "gemv", "gemm" or "dequant"
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    #: GEMV only: activations widened to float32 first (one small extra kernel; the GEMV then does
    #: no bf16/fp16 -> float32 conversion per weight).
    x_f32: bool = False
    #: GEMM only: programs per output tile along K (> 1: float32 partials and a reduce launch).
    split_k: int = 1
    #: GEMM only: scale the weights before the dot (see ``_gemm_kernel``). The GEMM's ``block_k``
    #: is cut to the group size where larger (a K tile never spans groups).
    scale_first: bool = False


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs: pretend an H100, so CPU tests take the GPU's choices
    return _sm_count(device_index(device))


def fit_block_k(group_size: int, block_k: int, inside_group: bool) -> int:
    """The largest power of two ``<= block_k`` that tiles groups: it divides ``group_size`` (or,
    unless ``inside_group``, is a multiple of it)."""
    bk = block_k
    while bk > 16 and group_size % bk and (inside_group or bk % group_size):
        bk //= 2
    return bk


def gemm_block_k(block_k: int, k: int, bits: int, split_k: int = 1) -> int:
    """The GEMM's K tile: the largest power of two ``<= block_k`` dividing ``k / split_k`` (at least
    16 inputs and one word per channel: the kernel has no K mask)."""
    bk = block_k
    per = k // split_k if k % split_k == 0 else k
    while bk > 16 and per % bk:
        bk //= 2
    return max(bk, 32 // bits)


def _widest_block_n(candidates: tuple[int, ...], n: int, programs_per_n: int, want: int) -> int:
    for bn in candidates:
        if triton.cdiv(n, bn) * programs_per_n >= want:
            return bn
    return candidates[-1]


#: up to this many rows the GEMV kernel runs; above, the fused GEMM (H100: at M = 2 the
#: GEMM took 12.9/8.9/54.0/20.2 us on qkv/o/gate_up/down, the 2-row GEMV 21.1/13.4/77.3/42.3).
GEMV_MAX_M = 1
#: up to this many rows the fused GEMM runs, above them dequantize + cuBLAS. H100, Llama-3-8B
#: linears: at M = 256 the GEMM took 42.4/28.6/192.4/93.7 us (qkv/o/gate_up/down), dequantize +
#: cuBLAS 49.3/34.4/211.8/115.7; at M = 1024 gate_up 669 vs 436 us, down 375 vs 208 us (linear
#: interpolation puts the crossing near M = 300-350; 256 is the last measured win).
GEMM_MAX_M = 256


def split_k_for(tiles: int, k: int, block_k: int, sms: int, min_steps: int = 4) -> int:
    """K splits (a power of two) so that ``tiles * split`` programs fill the SMs, each keeping at
    least ``min_steps`` K tiles (fewer and the float32 partials and the reduce launch dominate)."""
    split = 1
    while tiles * split < sms and k % (2 * split * block_k) == 0 and k // (2 * split * block_k) >= min_steps:
        split *= 2
    return split


def gemm_config(m: int, n: int, k: int, group_size: int, block_m: int, block_n: int, block_k: int,
                num_warps: int, num_stages: int, sms: int, scale_first: bool = False) -> KernelConfig:
    """A fused-GEMM config: ``block_k`` cut to the group and to a divisor of K, the K split chosen
    for the shape (``split_k_for``)."""
    bk = gemm_block_k(min(block_k, group_size), k, 4)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return KernelConfig("gemm", block_m, block_n, bk, num_warps, num_stages,
                        split_k=split_k_for(tiles, k, bk, sms), scale_first=scale_first)


def choose_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> KernelConfig:
    """Tile sizes for an ``[m, k] x [k, n]`` product (``benchmarks/bench_kernels.py --alts`` times alternatives;
    the figures below are H100 times of the Llama-3-8B linears)."""
    sms = _num_sms(device)
    if m <= GEMV_MAX_M:
        # 16 rows per program, 4 rows per thread sharing their activations, each warp streaming
        # 1 KB of one row per step. K steps of 2048 inputs, or all of K (up to 4096) in one step where
        # the outputs give few programs: o 6.79 -> 5.96 us, qkv 7.99 -> 7.55 us; gate_up (1792
        # programs) is slower that way (29.3 -> 31.5 us), and down's K = 14336 would need masks.
        bn = _widest_block_n((16, 8, 4), n, 1, sms)
        bk = k if k <= 4096 and triton.cdiv(n, bn) <= 4 * sms and k & (k - 1) == 0 else 2048
        return KernelConfig("gemv", 1, bn, fit_block_k(group_size, bk, inside_group=False), 4, 1)
    if m <= GEMM_MAX_M:
        # The fused dequantize-GEMM (weights as wgmma's 64-row operand, K split to fill the SMs).
        # H100 times (us, qkv/o/gate_up/down; ``--alts`` times the alternatives):
        # M <= 16: 16 x 128 tiles, 8 warps: 13.5/9.5/54.5/21.0 at M = 16 (16 x 64 with 4 warps:
        #   14.7/9.5/52.3/29.0; scale_first: 13.9/9.8/49.5/23.5).
        # M <= 64: 64 x 128, 8 warps, scale_first: 18.6/13.4/60.5/32.4 at M = 64 (the same without
        #   scale_first 23.1/15.7/95.9/47.0; 64 x 64 with 4 warps 18.6/12.4/86.5/37.5). Rows 17-32
        #   take this tile too (the masked rows cost tensor-core time only; M = 64 bounds them).
        # M <= 256: 128 x 64, 4 warps: 42.4/28.6/192.4/93.7 at M = 256 (128 x 128 with 8 warps
        #   65.0/39.7/219.0/113.7) -- still 0.55-0.62x bf16 (README: limits).
        if m <= 16:
            return gemm_config(m, n, k, group_size, 16, 128, 128, 8, 4, sms)
        if m <= 64:
            return gemm_config(m, n, k, group_size, 64, 128, 128, 8, 3, sms, scale_first=True)
        return gemm_config(m, n, k, group_size, 128, 64, 128, 4, 3, sms)
    return KernelConfig("dequant", 1, 16, fit_block_k(group_size, 512, inside_group=False), 4, 1)


def dequantize_weight(kw: KernelWeight, dtype: torch.dtype, config: KernelConfig | None = None) -> torch.Tensor:
    """``W [N, K]`` in ``dtype`` (kernel row order: act-order's rows stay permuted), one Triton pass."""
    k, n = kw.in_features, kw.out_features
    cfg = config or KernelConfig("dequant", 1, 16, fit_block_k(kw.group_size, 512, inside_group=False), 4, 1)
    plane = plane_words(kw.group_size, kw.bits)
    block_k = max(cfg.block_k, 32 // kw.bits * plane)  # whole plane blocks
    out = torch.empty((n, k), dtype=dtype, device=kw.qweight.device)
    zeros = kw.zeros if kw.zeros is not None else kw.qweight
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, cfg.block_n))
    _dequant_kernel[grid](kw.qweight, kw.scales, zeros, out, n, K=k, stride_qk=kw.qweight.stride(0),
                          stride_qn=kw.qweight.stride(1), BITS=kw.bits, GROUP=kw.group_size,
                          PLANE=plane, HAS_ZEROS=kw.zeros is not None, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def wna16_gemm(x: torch.Tensor, kw: KernelWeight, bias: torch.Tensor | None = None,
               config: KernelConfig | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with the Triton kernels (CUDA, or Triton's interpreter on the CPU).

    Args:
        x: ``[..., K]`` activations, float16, bfloat16 or float32.
        kw: the layer's packed weight.
        bias: optional ``[N]``.
        config: tile sizes; default ``choose_config``.
    """
    k, n = kw.in_features, kw.out_features
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    if m == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    cfg = config or choose_config(m, n, k, kw.group_size, x.device)
    if cfg.kind == "dequant":
        # Large M: compute-bound, so the weight is rebuilt in x's dtype (a scratch [N, K] whose
        # size depends on the shape only) and cuBLAS runs; act-order gathers x's columns instead.
        w = dequantize_weight(kw, x.dtype, cfg)
        xs = x2d.index_select(1, kw.perm) if kw.perm is not None else x2d
        return F.linear(xs, w, bias).reshape(*x.shape[:-1], n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # Absent operands get a placeholder pointer; their constexpr flag keeps it unread.
    zeros = kw.zeros if kw.zeros is not None else kw.qweight
    perm = kw.perm if kw.perm is not None else kw.qweight
    bias_arg = bias if bias is not None else kw.qweight
    flags = dict(HAS_ZEROS=kw.zeros is not None, HAS_PERM=kw.perm is not None, HAS_BIAS=bias is not None)
    plane = plane_words(kw.group_size, kw.bits)
    strides = dict(stride_xm=x2d.stride(0), stride_om=out.stride(0), stride_qk=kw.qweight.stride(0),
                   stride_qn=kw.qweight.stride(1))
    if cfg.kind == "gemv":
        block_k = max(cfg.block_k, 32 // kw.bits * plane)  # whole plane blocks
        if cfg.x_f32 and x2d.dtype != torch.float32:
            x2d = x2d.float()
            strides["stride_xm"] = x2d.stride(0)
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
        _gemv_kernel[grid](x2d, kw.qweight, kw.scales, zeros, perm, bias_arg, out, m, n, K=k, BITS=kw.bits,
                           GROUP=kw.group_size, PLANE=plane, EVEN_K=k % block_k == 0, USE_ASM=not _INTERPRETED,
                           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages, **strides, **flags)
    else:
        block_k = gemm_block_k(min(cfg.block_k, kw.group_size), k, kw.bits, cfg.split_k)
        split = cfg.split_k if k % (cfg.split_k * block_k) == 0 else 1
        dot_fp32 = x.dtype == torch.float32 or _INTERPRETED
        part = out
        if split > 1:
            part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
        _gemm_kernel[grid](x2d, kw.qweight, kw.scales, zeros, perm, bias_arg, out, part, m, n, K=k, BITS=kw.bits,
                           GROUP=kw.group_size, PLANE=plane, DOT_FP32=dot_fp32, USE_ASM=not _INTERPRETED,
                           SCALE_FIRST=cfg.scale_first, SPLIT_K=split, K_SPLIT=k // split,
                           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages, **strides, **flags)
        if split > 1:
            _splitk_reduce_kernel[(m, triton.cdiv(n, 1024))](part, bias_arg, out, m, n, out.stride(0),
                                                             HAS_BIAS=bias is not None, SPLIT_K=split,
                                                             BLOCK_N=1024, num_warps=4)
    return out.reshape(*x.shape[:-1], n)
