"""Triton dequantize-GEMM for GGUF blocks: ``y[m, n] = sum_k x[m, k] * W[n, k]`` with ``W`` read
straight from its ``uint8 [N, row_bytes]`` blocks (layouts in ``formats``).

Two kernels, one per shape of work, each specialised per GGML type (``QTYPE`` is a constexpr):

- ``_gemv_kernel`` (M = 1, decode at batch 1): one program per ``BLOCK_N`` rows and K split
  ``SPLIT_K`` ways, sized so the grid has several programs per SM; each block byte is read once.
  Codes are multiplied with ``x`` per sub-block first and the block's scale (and min) applied to
  the sums, so the per-element work is an extract and an FMA. Codes become floats by the
  exponent trick (``(q | 0x4B000000)`` as float32 minus 2**23: integer ops at full rate, where
  an int-to-float conversion runs at a quarter).
- ``_gemm_kernel`` (M >= 2): ``BLOCK_M x BLOCK_N`` tiles; each unit of 256 elements is
  dequantized into registers in the activation dtype and fed to ``tl.dot`` (K pieces of 64-256).

Both accumulate in float32 and write ``out[:, col0:col0 + N]`` of a wider output (so the shards of
a fused layer with different types fill one tensor). No host synchronisation: CUDA-graph safe.
A "unit" is 256 elements of a row: one super-block for Q4_K/Q6_K, eight 32-element blocks for
Q4_0/Q4_1/Q8_0 (the last unit of a row may be partial for those; the loads are masked).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from engine_quant_gguf.formats import KEPT, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, packed_row_bytes

# Triton's interpreter (CPU tests) multiplies bfloat16 tl.dot inputs wrongly; there the tiles are
# multiplied in float32 instead (the dequantization, the part under test, is the same code).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _to_f32(q):
    """Small non-negative int32 -> float32 without a conversion instruction."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _load_f16(ptr, offs):
    """A little-endian float16 at byte offsets ``offs`` (even), as float32."""
    return tl.load((ptr + offs).to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _load_f16_masked(ptr, offs, mask):
    return tl.load((ptr + offs).to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _q4k_scale_min(w_ptr, sb, s):
    """Q4_K (scale, min) of sub-blocks ``s`` (int tensor of 0..7) of the super-blocks at ``sb``."""
    sc_ptr = w_ptr + sb + 4
    low = s < 4
    a = tl.load(sc_ptr + tl.where(low, s, s + 4)).to(tl.int32)      # b[s] | b[s+4]
    b = tl.load(sc_ptr + tl.where(low, s + 4, s - 4)).to(tl.int32)  # b[s+4] | b[s-4]
    c = tl.load(sc_ptr + s).to(tl.int32)                            # b[s] (used for s >= 4)
    sc = tl.where(low, a & 63, (a & 15) | ((b >> 6) << 4))
    mn = tl.where(low, b & 63, (a >> 4) | ((c >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


# --------------------------------------------------------------------------------------------
# M < DENSE_MIN_M: the word kernel (codes read as int32 words)


@triton.jit
def _f16_bits(bits):
    """float16 bit pattern in the low 16 bits of an int32 -> float32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4k_words(x_ptr, w_ptr, acc, pid_m, M, rbase, x_stride, u0,
               UNITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``BLOCK_N`` rows x ``UNITS`` super-blocks x ``BLOCK_M`` activation rows per program.

    A Q4_K super-block is 36 int32 words (144 bytes, so every block is 4-byte aligned): word 0
    holds d | dmin, words 1-3 the 12 scale bytes, words 4-35 the 128 code bytes. Code word
    ``4 + 8j + w`` holds, in byte ``b``, element ``64j + 4w + b`` (low nibble, sub-block 2j) and
    ``64j + 32 + 4w + b`` (high nibble, sub-block 2j+1). Each row's 32 code words are one
    contiguous 128-byte run (16-byte vector loads); the next super-block's words are loaded
    before the current one is used (a hand-made two-stage pipeline). Per sub-block:
    ``y += d*sc * sum(x*q) - dmin*m * sum(x)``: the scales are applied to sums, not to elements.
    """
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    j = tl.arange(0, 4)
    w = tl.arange(0, 8)
    b = tl.arange(0, 4)
    jw = (8 * j[:, None] + w[None, :])                                   # [4, 8] code word
    x_cols = 64 * j[:, None, None] + 4 * w[None, :, None] + b[None, None, :]   # [4, 8, 4]
    shift = (8 * b)[None, None, None, :]                                  # [1, 1, 1, 4]
    s_lo = 2 * j[None, :]                                                 # sub-blocks [1, 4]
    s_hi = s_lo + 1
    low = s_lo < 4                                                        # same for s_hi
    sh = 8 * (s_lo & 3)                                                   # == 8 * (s_hi & 3)
    wp = w32 + rbase[:, None, None] + 4 + jw[None, :, :]                  # [BLOCK_N, 4, 8]
    hp = w32 + rbase[:, None]                                             # [BLOCK_N, 1]
    m_sel = tl.arange(0, BLOCK_M)[:, None]
    words = tl.load(wp + u0 * 36)
    for i in range(UNITS):
        u = u0 + i
        nxt = tl.load(wp + tl.minimum(u + 1, u0 + UNITS - 1) * 36)       # prefetch (the last one re-reads)
        h0 = tl.load(hp + u * 36)
        h1 = tl.load(hp + u * 36 + 1)
        h2 = tl.load(hp + u * 36 + 2)
        h3 = tl.load(hp + u * 36 + 3)
        d = _f16_bits(h0)                                                 # [BLOCK_N, 1]
        dmin = _f16_bits(h0 >> 16)
        # 6-bit (scale, min) of sub-block s: bytes 0-3 of the scales are h1, 4-7 h2, 8-11 h3
        sc_lo = tl.where(low, (h1 >> sh) & 63, ((h3 >> sh) & 15) | (((h1 >> (sh + 6)) & 3) << 4))
        mn_lo = tl.where(low, (h2 >> sh) & 63, ((h3 >> (sh + 4)) & 15) | (((h2 >> (sh + 6)) & 3) << 4))
        sh_hi = sh + 8
        sc_hi = tl.where(low, (h1 >> sh_hi) & 63, ((h3 >> sh_hi) & 15) | (((h1 >> (sh_hi + 6)) & 3) << 4))
        mn_hi = tl.where(low, (h2 >> sh_hi) & 63, ((h3 >> (sh_hi + 4)) & 15) | (((h2 >> (sh_hi + 6)) & 3) << 4))
        dsc_lo = d * sc_lo.to(tl.float32)                                # [BLOCK_N, 4]
        dsc_hi = d * sc_hi.to(tl.float32)
        dm_lo = dmin * mn_lo.to(tl.float32)
        dm_hi = dmin * mn_hi.to(tl.float32)
        q = words[:, :, :, None] >> shift                                 # [BLOCK_N, 4, 8, 4]
        q_lo = _to_f32(q & 15)
        q_hi = _to_f32((q >> 4) & 15)
        for mi in tl.static_range(BLOCK_M):
            xrow = x_ptr + tl.minimum(pid_m * BLOCK_M + mi, M - 1).to(tl.int64) * x_stride + u * 256
            x_lo = tl.load(xrow + x_cols).to(tl.float32)                  # [4, 8, 4]
            x_hi = tl.load(xrow + 32 + x_cols).to(tl.float32)
            t_lo = tl.sum(tl.sum(q_lo * x_lo[None], axis=3), axis=2)       # [BLOCK_N, 4]
            t_hi = tl.sum(tl.sum(q_hi * x_hi[None], axis=3), axis=2)
            xs_lo = tl.sum(tl.sum(x_lo, axis=2), axis=1)[None, :]          # [1, 4]
            xs_hi = tl.sum(tl.sum(x_hi, axis=2), axis=1)[None, :]
            part = tl.sum(dsc_lo * t_lo + dsc_hi * t_hi - dm_lo * xs_lo - dm_hi * xs_hi, axis=1)  # [BLOCK_N]
            acc += tl.where(m_sel == mi, part[None, :], 0.0)
        words = nxt
    return acc


@triton.jit
def _q8_0_words(x_ptr, w_ptr, acc, pid_m, M, rbase, x_stride, u0, K: tl.constexpr,
                UNITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Q8_0 (packed): a unit is 8 blocks of 8 code words; byte b of word w of block i is element
    ``32i + 4w + b``. Codes are biased to unsigned (``^ 0x80``): y += d * (sum(x*(q+128)) - 128*sum(x))."""
    NB: tl.constexpr = K // 32
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    f16 = w_ptr.to(tl.pointer_type(tl.float16))
    bi = tl.arange(0, 8)
    w = tl.arange(0, 8)
    b = tl.arange(0, 4)
    x_cols = 32 * bi[:, None, None] + 4 * w[None, :, None] + b[None, None, :]   # [8, 8, 4]
    shift = (8 * b)[None, None, None, :]
    cp = w32 + rbase[:, None, None] + (8 * bi[:, None] + w[None, :])[None]       # [BLOCK_N, 8, 8]
    dp = f16 + 2 * rbase[:, None] + K // 2 + bi[None, :]                       # [BLOCK_N, 8]
    m_sel = tl.arange(0, BLOCK_M)[:, None]
    words = tl.load(cp + u0 * 64, mask=(8 * u0 + bi < NB)[None, :, None], other=0)
    for i in range(UNITS):
        u = u0 + i
        un = tl.minimum(u + 1, u0 + UNITS - 1)
        nxt = tl.load(cp + un * 64, mask=(8 * un + bi < NB)[None, :, None], other=0)
        ok = 8 * u + bi < NB                                                    # [8]
        d = tl.load(dp + 8 * u, mask=ok[None, :], other=0.0).to(tl.float32)    # [BLOCK_N, 8]
        q = _to_f32(((words ^ -2139062144)[:, :, :, None] >> shift) & 255)      # q + 128, [BLOCK_N, 8, 8, 4]
        for mi in tl.static_range(BLOCK_M):
            xrow = x_ptr + tl.minimum(pid_m * BLOCK_M + mi, M - 1).to(tl.int64) * x_stride + u * 256
            xv = tl.load(xrow + x_cols, mask=ok[:, None, None], other=0.0).to(tl.float32)
            t = tl.sum(tl.sum(q * xv[None], axis=3), axis=2)                    # [BLOCK_N, 8]
            xs = tl.sum(tl.sum(xv, axis=2), axis=1)[None, :]
            part = tl.sum(d * (t - 128.0 * xs), axis=1)
            acc += tl.where(m_sel == mi, part[None, :], 0.0)
        words = nxt
    return acc


@triton.jit
def _q4_x_words(x_ptr, w_ptr, acc, pid_m, M, rbase, x_stride, u0, K: tl.constexpr, QTYPE: tl.constexpr,
                UNITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Q4_0 / Q4_1 (packed): a unit is 8 blocks of 4 code words; byte b of word w of block i holds
    element ``32i + 4w + b`` (low nibble) and ``32i + 16 + 4w + b`` (high)."""
    NB: tl.constexpr = K // 32
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    f16 = w_ptr.to(tl.pointer_type(tl.float16))
    bi = tl.arange(0, 8)
    w = tl.arange(0, 4)
    b = tl.arange(0, 4)
    x_cols = 32 * bi[:, None, None] + 4 * w[None, :, None] + b[None, None, :]   # [8, 4, 4]
    shift = (8 * b)[None, None, None, :]
    cp = w32 + rbase[:, None, None] + (4 * bi[:, None] + w[None, :])[None]       # [BLOCK_N, 8, 4]
    dp = f16 + 2 * rbase[:, None] + K // 4 + bi[None, :]                       # [BLOCK_N, 8]
    m_sel = tl.arange(0, BLOCK_M)[:, None]
    words = tl.load(cp + u0 * 32, mask=(8 * u0 + bi < NB)[None, :, None], other=0)
    for i in range(UNITS):
        u = u0 + i
        un = tl.minimum(u + 1, u0 + UNITS - 1)
        nxt = tl.load(cp + un * 32, mask=(8 * un + bi < NB)[None, :, None], other=0)
        ok = 8 * u + bi < NB
        d = tl.load(dp + 8 * u, mask=ok[None, :], other=0.0).to(tl.float32)
        if QTYPE == 3:
            mn = tl.load(dp + NB + 8 * u, mask=ok[None, :], other=0.0).to(tl.float32)
        q = words[:, :, :, None] >> shift                                       # [BLOCK_N, 8, 4, 4]
        q_lo = _to_f32(q & 15)
        q_hi = _to_f32((q >> 4) & 15)
        for mi in tl.static_range(BLOCK_M):
            xrow = x_ptr + tl.minimum(pid_m * BLOCK_M + mi, M - 1).to(tl.int64) * x_stride + u * 256
            x_lo = tl.load(xrow + x_cols, mask=ok[:, None, None], other=0.0).to(tl.float32)
            x_hi = tl.load(xrow + 16 + x_cols, mask=ok[:, None, None], other=0.0).to(tl.float32)
            t = tl.sum(tl.sum(q_lo * x_lo[None] + q_hi * x_hi[None], axis=3), axis=2)   # [BLOCK_N, 8]
            xs = tl.sum(tl.sum(x_lo + x_hi, axis=2), axis=1)[None, :]
            if QTYPE == 2:
                part = tl.sum(d * (t - 8.0 * xs), axis=1)
            else:
                part = tl.sum(d * t + mn * xs, axis=1)
            acc += tl.where(m_sel == mi, part[None, :], 0.0)
        words = nxt
    return acc


@triton.jit
def _q6k_words(x_ptr, w_ptr, acc, pid_m, M, rbase, x_stride, u0, K: tl.constexpr,
               UNITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Q6_K (packed: ql, qh, scales, d runs). Element ``128h + 32t + 16g + 4w + b`` (half h,
    quarter t, group g, word w, byte b; ``hg = 2h + g``): low 4 bits in ql word ``16h + 8(t%2) + 4g + w``
    (nibble t//2 of byte b), high 2 bits in qh word ``8h + 4g + w`` (bits 2t of byte b), scale
    ``8h + 2t + g``. y += d * sum(sc * (sum(x*q) - 32*sum(x))) per 16 elements."""
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    i8 = w_ptr.to(tl.pointer_type(tl.int8))
    f16 = w_ptr.to(tl.pointer_type(tl.float16))
    hg = tl.arange(0, 4)
    w = tl.arange(0, 4)
    b = tl.arange(0, 4)
    hh = hg >> 1
    gg = hg & 1
    x_cols = (128 * hh + 16 * gg)[:, None, None] + 4 * w[None, :, None] + b[None, None, :]  # [4, 4, 4] (+32t)
    ql_w = (16 * hh + 4 * gg)[:, None] + w[None, :]                            # [4, 4] (+8 for odd t)
    qh_w = (4 * hg)[:, None] + w[None, :]
    sc_i = 8 * hh + gg                                                          # [4] (+2t)
    b4 = b[None, None, None, :]
    pa = w32 + rbase[:, None, None] + ql_w[None]                                # [BLOCK_N, 4, 4]
    ph = w32 + rbase[:, None, None] + K // 8 + qh_w[None]
    ps = i8 + 4 * rbase[:, None] + (3 * K) // 4 + sc_i[None, :]                 # [BLOCK_N, 4]
    pd = f16 + 2 * rbase + (3 * K) // 8 + K // 32                               # [BLOCK_N]
    m_sel = tl.arange(0, BLOCK_M)[:, None]
    a0 = tl.load(pa + u0 * 32)
    a1 = tl.load(pa + u0 * 32 + 8)
    qh = tl.load(ph + u0 * 16)
    for i in range(UNITS):
        u = u0 + i
        un = tl.minimum(u + 1, u0 + UNITS - 1)
        n0 = tl.load(pa + un * 32)
        n1 = tl.load(pa + un * 32 + 8)
        nh = tl.load(ph + un * 16)
        d = tl.load(pd + u).to(tl.float32)                                      # [BLOCK_N]
        qhe = qh[:, :, :, None]
        part4 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for t in tl.static_range(4):
            if t % 2 == 0:
                lw = a0[:, :, :, None]
            else:
                lw = a1[:, :, :, None]
            q = _to_f32(((lw >> (8 * b4 + 4 * (t // 2))) & 15) | (((qhe >> (8 * b4 + 2 * t)) & 3) << 4))  # [BN, 4, 4, 4]
            sc = tl.load(ps + 16 * u + 2 * t).to(tl.float32)                    # [BLOCK_N, 4]
            for mi in tl.static_range(BLOCK_M):
                xrow = x_ptr + tl.minimum(pid_m * BLOCK_M + mi, M - 1).to(tl.int64) * x_stride + u * 256
                xv = tl.load(xrow + 32 * t + x_cols).to(tl.float32)            # [4, 4, 4]
                s = tl.sum(tl.sum(q * xv[None], axis=3), axis=2)                # [BLOCK_N, 4]
                xs = tl.sum(tl.sum(xv, axis=2), axis=1)[None, :]
                part = tl.sum(sc * (s - 32.0 * xs), axis=1)
                part4 += tl.where(m_sel == mi, part[None, :], 0.0)
        acc += part4 * d[None, :]
        a0 = n0
        a1 = n1
        qh = nh
    return acc


@triton.jit
def _word_kernel(x_ptr, w_ptr, out_ptr, M, N, row_words, x_stride, out_stride, split_stride, K: tl.constexpr,
                 QTYPE: tl.constexpr, UNITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[m, n] (+ split partials) = x[m] . W[n]`` for ``BLOCK_M`` activation rows x ``BLOCK_N``
    weight rows x ``UNITS`` units of 256 elements (``program_id(1)`` picks the K split)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N read row N-1 (valid memory, result dropped): no masks on the hot loads.
    rbase = tl.minimum(rows, N - 1).to(tl.int64) * row_words
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u0 = pid_k * UNITS
    if QTYPE == 12:
        acc = _q4k_words(x_ptr, w_ptr, acc, pid_m, M, rbase, x_stride, u0, UNITS, BLOCK_M, BLOCK_N)
    elif QTYPE == 14:
        acc = _q6k_words(x_ptr, w_ptr, acc, pid_m, M, rbase, x_stride, u0, K, UNITS, BLOCK_M, BLOCK_N)
    elif QTYPE == 8:
        acc = _q8_0_words(x_ptr, w_ptr, acc, pid_m, M, rbase, x_stride, u0, K, UNITS, BLOCK_M, BLOCK_N)
    else:
        acc = _q4_x_words(x_ptr, w_ptr, acc, pid_m, M, rbase, x_stride, u0, K, QTYPE, UNITS, BLOCK_M, BLOCK_N)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    out = out_ptr + pid_k * split_stride + ms.to(tl.int64)[:, None] * out_stride + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(ms < M)[:, None] & (rows < N)[None, :])


# --------------------------------------------------------------------------------------------
# larger M: dequantize into a scratch tensor, then cuBLAS


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, N, row_bytes, K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """One unit (256 elements) of ``BLOCK_N`` rows per program (packed layout) -> ``out [N, K]``.
    The float operations are ``formats.dequantize``'s, in float32: bit-identical before the cast."""
    pid_n = tl.program_id(0)
    u = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < N
    row_off = tl.minimum(rows, N - 1).to(tl.int64) * row_bytes
    dst = out_ptr + rows.to(tl.int64) * K + u * 256                      # [BLOCK_N]
    odt = out_ptr.dtype.element_ty
    if QTYPE == 12:  # Q4_K (GGUF layout)
        j = tl.arange(0, 4)
        l = tl.arange(0, 32)
        q_cols = 16 + 32 * j[:, None] + l[None, :]
        x_cols = 64 * j[:, None] + l[None, :]                             # [4, 32]
        sb = row_off[:, None] + u * 144
        d = _load_f16(w_ptr, sb)
        dmin = _load_f16(w_ptr, sb + 2)
        sc_lo, mn_lo = _q4k_scale_min(w_ptr, sb, 2 * j[None, :])
        sc_hi, mn_hi = _q4k_scale_min(w_ptr, sb, 2 * j[None, :] + 1)
        qs = tl.load(w_ptr + sb[:, :, None] + q_cols[None, :, :]).to(tl.int32)
        w_lo = (d * sc_lo)[:, :, None] * (qs & 15).to(tl.float32) - (dmin * mn_lo)[:, :, None]
        w_hi = (d * sc_hi)[:, :, None] * (qs >> 4).to(tl.float32) - (dmin * mn_hi)[:, :, None]
        tl.store(dst[:, None, None] + x_cols[None], w_lo.to(odt), mask=r_ok[:, None, None])
        tl.store(dst[:, None, None] + 32 + x_cols[None], w_hi.to(odt), mask=r_ok[:, None, None])
    elif QTYPE == 14:  # Q6_K (packed): ql [K/2], qh [K/4], scales [K/16], d [K/256]
        h = tl.arange(0, 2)[:, None, None]
        g = tl.arange(0, 2)[None, :, None]
        i = tl.arange(0, 16)[None, None, :]
        pos = 16 * g + i
        r4 = row_off[:, None, None, None]
        d = _load_f16(w_ptr, row_off + (3 * K) // 4 + K // 16 + 2 * u)[:, None, None, None]
        ql0 = tl.load(w_ptr + r4 + 128 * u + (64 * h + pos)[None]).to(tl.int32)
        ql1 = tl.load(w_ptr + r4 + 128 * u + (64 * h + 32 + pos)[None]).to(tl.int32)
        qh = tl.load(w_ptr + r4 + K // 2 + 64 * u + (32 * h + pos)[None]).to(tl.int32)
        for t in tl.static_range(4):
            if t == 0:
                lowbits = ql0 & 15
            elif t == 1:
                lowbits = ql1 & 15
            elif t == 2:
                lowbits = ql0 >> 4
            else:
                lowbits = ql1 >> 4
            q = (lowbits | (((qh >> (2 * t)) & 3) << 4)) - 32
            sc = tl.load((w_ptr + r4 + (3 * K) // 4 + 16 * u + (8 * h + 2 * t + g)[None]).to(tl.pointer_type(tl.int8)))
            wv = (d * sc.to(tl.float32)) * q.to(tl.float32)
            cols = (128 * h + 32 * t + pos)[None]
            tl.store(dst[:, None, None, None] + cols, wv.to(odt), mask=r_ok[:, None, None, None])
    else:  # Q4_0 / Q4_1 / Q8_0 (packed): codes, then d (then m)
        n_blocks: tl.constexpr = K // 32
        CODE: tl.constexpr = 32 if QTYPE == 8 else 16                     # code bytes per block
        bi = tl.arange(0, 8)
        blk = u * 8 + bi
        ok = blk < n_blocks
        dp = row_off[:, None] + CODE * n_blocks + 2 * blk[None, :]         # [BLOCK_N, 8]
        d = _load_f16_masked(w_ptr, dp, ok[None, :])[:, :, None]
        st_ok = r_ok[:, None, None] & ok[None, :, None]
        cb = row_off[:, None, None] + CODE * blk[None, :, None]
        if QTYPE == 8:
            e = tl.arange(0, 32)
            qs = tl.load((w_ptr + cb + e[None, None, :]).to(tl.pointer_type(tl.int8)), mask=ok[None, :, None], other=0)
            tl.store(dst[:, None, None] + (32 * bi[:, None] + e[None, :])[None], (qs.to(tl.float32) * d).to(odt),
                     mask=st_ok)
        else:
            e = tl.arange(0, 16)
            qs = tl.load(w_ptr + cb + e[None, None, :], mask=ok[None, :, None], other=0).to(tl.int32)
            if QTYPE == 2:
                w_lo = d * ((qs & 15) - 8).to(tl.float32)
                w_hi = d * ((qs >> 4) - 8).to(tl.float32)
            else:
                m = _load_f16_masked(w_ptr, dp + 2 * n_blocks, ok[None, :])[:, :, None]
                w_lo = d * (qs & 15).to(tl.float32) + m
                w_hi = d * (qs >> 4).to(tl.float32) + m
            cols = (32 * bi[:, None] + e[None, :])[None]
            tl.store(dst[:, None, None] + cols, w_lo.to(odt), mask=st_ok)
            tl.store(dst[:, None, None] + 16 + cols, w_hi.to(odt), mask=st_ok)


# --------------------------------------------------------------------------------------------
# launch


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count if torch.cuda.is_available() else 8


#: from this many activation rows on, the weight is dequantized into a scratch tensor of the
#: activation dtype and multiplied by cuBLAS (``torch.mm``); below it the word kernel runs.
DENSE_MIN_M: dict[int, int] = {}
DENSE_MIN_M_DEFAULT = 9


def word_config(qtype: int, m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_K, num_warps) of the word kernel: the one place to tune it.

    ``BLOCK_N`` rows per program so that each thread holds several rows of the same code words
    (the activations it loads serve them all); K is split (partial sums added in a fixed order)
    until the grid has about 4 programs per SM, keeping at least 2 units per split.
    """
    units = -(-k // 256)
    block_m = 1 if m == 1 else min(triton.next_power_of_2(m), 4)
    block_n = 32
    tiles = -(-n // block_n) * -(-m // block_m)
    split = 1
    if tiles < 4 * sms:
        want = -(-4 * sms // tiles)
        split = max(s for s in range(1, min(want, max(units // 2, 1)) + 1) if units % s == 0)
    return block_m, block_n, split, 4


def dequantize_blocks(packed: torch.Tensor, qtype: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed blocks ``uint8 [n, packed_row_bytes]`` -> ``dtype [n, k]`` with one Triton kernel."""
    n = packed.shape[0]
    dense = torch.empty(n, k, dtype=dtype, device=packed.device)
    _dequant_kernel[(triton.cdiv(n, 16), triton.cdiv(k, 256))](packed, dense, n, packed.shape[1], K=k, QTYPE=qtype,
                                                               BLOCK_N=16, num_warps=4)
    return dense


def gguf_matmul(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int,
                out: torch.Tensor | None = None, col0: int = 0) -> torch.Tensor:
    """``x [M, K] @ W.T`` for ``W`` held as ``packed`` (``formats.pack`` of its ``uint8 [n, row_bytes]``
    GGUF blocks of ``qtype``).

    Writes columns ``col0 .. col0 + n`` of ``out`` (``[M, >= col0 + n]``, x's dtype, last dim
    contiguous) when given, else a new ``[M, n]`` tensor; returns the ``[M, n]`` view.
    M < ``DENSE_MIN_M``: the word kernel (weights read once per ``BLOCK_M`` rows); else dequantize
    into a scratch tensor and ``torch.mm`` (cuBLAS). No host synchronisation: graph-safe.
    """
    assert qtype in KEPT and packed.dtype == torch.uint8 and x.dim() == 2
    m, k = x.shape
    assert packed.shape[1] == packed_row_bytes(qtype, k), "blocks must be in formats.pack's layout"
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        col0 = 0
    target = out[:, col0:col0 + n]
    if m == 0:
        return target
    if m >= DENSE_MIN_M.get(qtype, DENSE_MIN_M_DEFAULT):
        dense = dequantize_blocks(packed, qtype, k, x.dtype)
        if target.is_contiguous():
            torch.mm(x, dense.t(), out=target)
        else:
            target.copy_(torch.mm(x, dense.t()))
        return target
    sms = _sm_count(x.device.index or 0) if x.is_cuda else 8
    block_m, block_n, split, warps = word_config(qtype, m, n, k, sms)
    units = -(-k // 256)
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    row_words = packed.shape[1] // 4
    if split == 1:
        _word_kernel[grid](x, packed, target, m, n, row_words, x.stride(0), out.stride(0), 0, K=k, QTYPE=qtype,
                           UNITS=units, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    else:  # partial sums per split, added in a fixed order: deterministic, graph-safe
        partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        _word_kernel[grid](x, packed, partial, m, n, row_words, x.stride(0), n, m * n, K=k, QTYPE=qtype,
                           UNITS=units // split, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        if target.is_contiguous():
            torch.sum(partial, 0, out=target)
        else:
            target.copy_(partial.sum(0))
    return target


__all__ = ["gguf_matmul", "word_config", "dequantize_blocks", "DENSE_MIN_M", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
