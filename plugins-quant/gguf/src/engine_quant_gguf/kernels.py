"""Triton kernels for GGUF weights on CUDA: ``y[m, n] = sum_k x[m, k] * W[n, k]`` with ``W`` held
in ``formats.pack``'s *planes* layout (the same quantized data; codes as int32 words in plane
order, one 16-byte vector a *unit* of 32 inputs (Q8_0: 16, Q6_K: 64 in two vectors plus one of
high bits), then the scale runs; rows padded to 64 bytes).

- ``_gemv_kernel`` (M <= 2, decode): tiles ``[BN rows, NU units, 4 words]``; a thread loads 16
  bytes of codes a unit (a warp streams contiguous 512-byte runs of a row), and slot ``i`` of its
  4 words pairs with 4 consecutive activations (one vector load, addressed with the weight tile's
  shape, stride 0 over rows, so it takes the weight's register layout). A code becomes a float by
  OR-ing it into the mantissa of ``2**(23 - s)`` (one LOP3) and subtracting that power (one FADD),
  never an int->float conversion; the scale (and min) apply once per unit to the float32 sums
  ``d*sc * sum(q*x) - dmin*m * sum(x)``. BLOCK_M = 2 reads the weight once for both rows.
  The row's units are spread over the program's threads and warps (``NU`` a step) and reduced
  once at the end; K may also be split over programs (float32 partials summed in a fixed order).
- ``_gemm_kernel`` (3 <= M <= ``GEMM_MAX_M``): ``tl.dot`` tiles; each ``[BLOCK_N, BLOCK_K]``
  weight tile is dequantized in registers (``_dequant_tile``: the float operations of
  ``formats.dequantize``), cast to the activation dtype and multiplied with float32 accumulation.
- ``_dequant_kernel`` + ``torch.mm`` (larger M): the weight dequantized into a scratch tensor of
  the activation dtype (``_dequant_tile`` again, products rounded separately: bit-identical to
  ``formats.dequantize`` before the cast) and cuBLAS.

All write ``out[:, col0:col0 + N]`` of a wider output (the shards of a fused layer of mixed
types fill one tensor). No host synchronisation: CUDA-graph safe. ``K`` is a compile-time
constant (a model has two or three).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from engine_quant_gguf.formats import KEPT, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, packed_row_bytes

# Triton's interpreter (CPU tests): no inline PTX, and 16-bit tl.dot is widened to float32 first.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _code(w, hi, S: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """The unsigned ``BITS``-bit field at bit ``S`` of int32 ``w`` as an exact float32 (``hi`` is
    ``w >> 16``): the field OR-ed into the mantissa of ``2**(23 - s)`` minus that power."""
    if S >= 16:
        src = hi
    else:
        src = w
    SS: tl.constexpr = S % 16
    MASK: tl.constexpr = (2 ** BITS - 1) * 2 ** SS
    EXP: tl.constexpr = (150 - SS) * 8388608
    if USE_ASM:
        bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [src, tl.zeros_like(src) + MASK, tl.zeros_like(src) + EXP],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (src & MASK) | EXP
    return bits.to(tl.float32, bitcast=True) - 2.0 ** (23 - SS)


@triton.jit
def _f16_lo(bits):
    """float16 bit pattern in the low 16 bits of an int32 -> float32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _mul_rn(a, b, EXACT: tl.constexpr):
    """``a * b`` rounded on its own (never fused into an FMA by the compiler) where EXACT."""
    if EXACT:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


# --------------------------------------------------------------------------------------------
# M <= 2: the GEMV


@triton.jit
def _pick(ptr, idx, jj):
    """``ptr[idx]`` (``idx [BN, NU, 1]``) as int32 ``[BN, NU]`` in the layout of the tile's sums: the
    aligned vector of 4 entries holding it is loaded with the code tile's shape (``jj`` = 0..3,
    so the load takes the codes' register layout) and the entry selected in registers. The vector
    may reach 3 entries past a run: rows end with at least 16 spare bytes (``formats.pack``)."""
    v = tl.load(ptr + 4 * (idx // 4) + jj).to(tl.int32)
    return tl.sum(tl.where(jj == idx % 4, v, 0), 2)


@triton.jit
def _dot_slots(w, hi, xa, xb, t_a, t_b, s_a, s_b, I0: tl.constexpr, N_SLOTS: tl.constexpr,
               BITS: tl.constexpr, UE: tl.constexpr, TWO: tl.constexpr, USE_ASM: tl.constexpr):
    """Adds ``code * x`` and ``x`` of slots ``I0 .. I0 + N_SLOTS`` of the words ``w`` into the
    running sums of row a (and b)."""
    # (loop-derived values stay inline: a name assigned in the loop would become a run-time value)
    for ii in tl.static_range(N_SLOTS):
        q = _code(w, hi, BITS * (I0 + ii), BITS, USE_ASM)
        xv = tl.load(xa + 4 * (I0 + ii)).to(tl.float32)
        t_a += q * xv
        s_a += xv
        if TWO:
            xv2 = tl.load(xb + 4 * (I0 + ii)).to(tl.float32)
            t_b += q * xv2
            s_b += xv2
    return t_a, t_b, s_a, s_b


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, x_stride, out_stride, row_words, split_stride,
                 K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr, NU: tl.constexpr,
                 SPLIT: tl.constexpr, USE_ASM: tl.constexpr):
    UE: tl.constexpr = 64 if QTYPE == 14 else (16 if QTYPE == 8 else 32)  # inputs a unit
    UNITS: tl.constexpr = K // UE
    UPS: tl.constexpr = UNITS // SPLIT                                     # units a split
    EVEN: tl.constexpr = UPS % NU == 0
    TWO: tl.constexpr = BLOCK_M == 2
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BN + tl.arange(0, BN)
    # Rows past N read row N - 1 (valid memory, result dropped).
    rw = (tl.minimum(rows, N - 1).to(tl.int64) * row_words)[:, None, None]                  # [BN, 1, 1]
    uu = tl.arange(0, NU)[None, :, None]                                                   # [1, NU, 1]
    uu2 = tl.arange(0, NU)[None, :]
    jj = tl.arange(0, 4)[None, None, :]                                                    # [1, 1, 4]
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    u16 = w_ptr.to(tl.pointer_type(tl.int16))
    m0 = pid_m * BLOCK_M
    m1 = tl.minimum(m0 + 1, M - 1)
    # Activations addressed with the weight tile's shape (stride 0 over rows): same layout.
    no_n = (rows * 0)[:, None, None]
    xa_row = x_ptr + m0.to(tl.int64) * x_stride + no_n + jj
    xb_row = x_ptr + m1.to(tl.int64) * x_stride + no_n + jj
    # Accumulators made by a reduction of the tile shape: they take the sums' layout (no conversion).
    acc_a = tl.sum(tl.zeros([BN, NU, 4], dtype=tl.float32), 2)
    acc_b = tl.sum(tl.zeros([BN, NU, 4], dtype=tl.float32), 2)
    u_end = (pid_k + 1) * UPS
    for it in range(0, UPS, NU):
        u = pid_k * UPS + it + uu                                                          # [1, NU, 1]
        u2 = pid_k * UPS + it + uu2                                                        # [1, NU]
        if not EVEN:
            ok = (u2 < u_end) & (rows == rows)[:, None]                                    # [BN, NU]
            u = tl.minimum(u, u_end - 1)  # masked units re-read the last one; their sums are dropped
            u2 = tl.minimum(u2, u_end - 1)
        xa = xa_row + UE * u
        xb = xb_row + UE * u
        t_a = tl.zeros([BN, NU, 4], dtype=tl.float32)
        t_b = tl.zeros([BN, NU, 4], dtype=tl.float32)
        s_a = tl.zeros([BN, NU, 4], dtype=tl.float32)
        s_b = tl.zeros([BN, NU, 4], dtype=tl.float32)
        if QTYPE == 14:  # Q6_K: two halves of 32, each two scale groups of 16
            qh = tl.load(w32 + rw + K // 8 + 4 * u + jj)
            qhh = qh >> 16
            scw = _pick(w32 + rw + (3 * K) // 16, u, jj)                                   # 4 int8 scales
            d = _f16_lo(_pick(u16 + 2 * rw + (13 * K) // 32, u // 4, jj))
            for h in tl.static_range(2):
                ql = tl.load(w32 + rw + 8 * u + 4 * h + jj)
                qlh = ql >> 16
                for g in tl.static_range(2):
                    t_a = tl.zeros([BN, NU, 4], dtype=tl.float32)
                    t_b = tl.zeros([BN, NU, 4], dtype=tl.float32)
                    s_a = tl.zeros([BN, NU, 4], dtype=tl.float32)
                    s_b = tl.zeros([BN, NU, 4], dtype=tl.float32)
                    for ii in tl.static_range(4):  # slot 4g + ii
                        lo = _code(ql, qlh, 4 * (4 * g + ii), 4, USE_ASM)
                        hb = _code(qh, qhh, 2 * (8 * h + 4 * g + ii), 2, USE_ASM)
                        q = lo + 16.0 * hb
                        xv = tl.load(xa + 32 * h + 4 * (4 * g + ii)).to(tl.float32)
                        t_a += q * xv
                        s_a += xv
                        if TWO:
                            xv2 = tl.load(xb + 32 * h + 4 * (4 * g + ii)).to(tl.float32)
                            t_b += q * xv2
                            s_b += xv2
                    sc = ((scw << (24 - 8 * (2 * h + g))) >> 24).to(tl.float32)  # scale group 2h + g
                    dsc = d * sc
                    part = dsc * (tl.sum(t_a, 2) - 32.0 * tl.sum(s_a, 2))
                    if not EVEN:
                        part = tl.where(ok, part, 0.0)
                    acc_a += part
                    if TWO:
                        part_b = dsc * (tl.sum(t_b, 2) - 32.0 * tl.sum(s_b, 2))
                        if not EVEN:
                            part_b = tl.where(ok, part_b, 0.0)
                        acc_b += part_b
        else:
            w = tl.load(w32 + rw + 4 * u + jj)
            hi = w >> 16
            if QTYPE == 8:
                w = w ^ -2139062144  # 0x80808080: each int8 code + 128, unsigned
                hi = w >> 16
                t_a, t_b, s_a, s_b = _dot_slots(w, hi, xa, xb, t_a, t_b, s_a, s_b, 0, 4, 8, UE, TWO, USE_ASM)
            else:
                t_a, t_b, s_a, s_b = _dot_slots(w, hi, xa, xb, t_a, t_b, s_a, s_b, 0, 8, 4, UE, TWO, USE_ASM)
            if QTYPE == 2:  # Q4_0: d (q - 8)
                d = _f16_lo(_pick(u16 + 2 * rw + K // 4, u, jj))
                scale = d
                bias = -8.0 * d
            elif QTYPE == 3:  # Q4_1: d q + m
                dm = _pick(w32 + rw + K // 8, u, jj)
                scale = _f16_lo(dm)
                bias = _f16_lo(dm >> 16)
            elif QTYPE == 8:  # Q8_0: d (q + 128) - 128 d
                d = _f16_lo(_pick(u16 + 2 * rw + K // 2, u // 2, jj))
                scale = d
                bias = -128.0 * d
            else:  # Q4_K: (d sc) q - dmin mn
                dm = _pick(w32 + rw + K // 8, u // 8, jj)
                scmn = _pick(u16 + 2 * rw + K // 4 + K // 128, u, jj)
                scale = _f16_lo(dm) * (scmn & 255).to(tl.float32)
                bias = -(_f16_lo(dm >> 16) * ((scmn >> 8) & 255).to(tl.float32))
            part = scale * tl.sum(t_a, 2) + bias * tl.sum(s_a, 2)
            if not EVEN:
                part = tl.where(ok, part, 0.0)
            acc_a += part
            if TWO:
                part_b = scale * tl.sum(t_b, 2) + bias * tl.sum(s_b, 2)
                if not EVEN:
                    part_b = tl.where(ok, part_b, 0.0)
                acc_b += part_b
    n_ok = rows < N
    out = out_ptr + pid_k * split_stride + rows
    tl.store(out + m0.to(tl.int64) * out_stride, tl.sum(acc_a, 1).to(out_ptr.dtype.element_ty), mask=n_ok)
    if TWO:
        tl.store(out + (m0 + 1).to(tl.int64) * out_stride, tl.sum(acc_b, 1).to(out_ptr.dtype.element_ty),
                 mask=n_ok & (m0 + 1 < M))


# --------------------------------------------------------------------------------------------
# A weight tile dequantized in registers (the GEMM and the dequantize kernel)


@triton.jit
def _dequant_tile(w_ptr, rw, k0, K: tl.constexpr, QTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  EXACT: tl.constexpr):
    """float32 ``[BN, BK]``: inputs ``k0 .. k0 + BK`` of the rows at word offsets ``rw`` (``[BN]``),
    with ``formats.dequantize``'s float operations (each product rounded where ``EXACT``)."""
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    u16 = w_ptr.to(tl.pointer_type(tl.int16))
    i8 = w_ptr.to(tl.pointer_type(tl.int8))
    r3 = rw[:, None, None]
    j = tl.arange(0, 4)[None, None, :]
    if QTYPE == 14:  # Q6_K: units of 64 = (half h, slot i, word j)
        V: tl.constexpr = BK // 64
        v = (k0 // 64 + tl.arange(0, V))[None, :, None]                                    # [1, V, 1]
        r5 = rw[:, None, None, None, None]
        v5 = v[:, :, :, None, None]
        h = tl.arange(0, 2)[None, None, :, None, None]
        i = tl.arange(0, 8)[None, None, None, :, None]
        j5 = tl.arange(0, 4)[None, None, None, None, :]
        ql = tl.load(w32 + r5 + 8 * v5 + 4 * h + j5)                                       # [BN, V, 2, 1, 4]
        qh = tl.load(w32 + r5 + K // 8 + 4 * v5 + j5)                                      # [BN, V, 1, 1, 4]
        q = ((ql >> (4 * i)) & 15) | (((qh >> (2 * (8 * h + i))) & 3) << 4)                # [BN, V, 2, 8, 4]
        g = 4 * v5 + 2 * h + i // 4                                                        # 16-input group
        sc = tl.load(i8 + 4 * r5 + (3 * K) // 4 + g).to(tl.float32)
        d = _f16_lo(tl.load(u16 + 2 * r5 + (13 * K) // 32 + v5 // 4).to(tl.int32))
        wt = _mul_rn(_mul_rn(d, sc, EXACT), (q - 32).to(tl.float32), EXACT)
    elif QTYPE == 8:  # Q8_0: units of 16 = (slot i, word j)
        U: tl.constexpr = BK // 16
        u = (k0 // 16 + tl.arange(0, U))[None, :, None, None]
        i = tl.arange(0, 4)[None, None, :, None]
        w = tl.load(w32 + r3[:, :, :, None] + 4 * u + j[:, :, None, :])                    # [BN, U, 1, 4]
        q = (w << (24 - 8 * i)) >> 24                                                      # [BN, U, 4, 4]
        d = _f16_lo(tl.load(u16 + 2 * r3[:, :, :, None] + K // 2 + u // 2).to(tl.int32))
        wt = _mul_rn(q.to(tl.float32), d, EXACT)
    else:  # Q4_0 / Q4_1 / Q4_K: units of 32 = (slot i, word j)
        U: tl.constexpr = BK // 32
        u = (k0 // 32 + tl.arange(0, U))[None, :, None, None]
        i = tl.arange(0, 8)[None, None, :, None]
        r4 = r3[:, :, :, None]
        w = tl.load(w32 + r4 + 4 * u + j[:, :, None, :])                                   # [BN, U, 1, 4]
        q = (w >> (4 * i)) & 15                                                            # [BN, U, 8, 4]
        if QTYPE == 2:
            d = _f16_lo(tl.load(u16 + 2 * r4 + K // 4 + u).to(tl.int32))
            wt = _mul_rn(d, (q - 8).to(tl.float32), EXACT)
        elif QTYPE == 3:
            dm = tl.load(w32 + r4 + K // 8 + u)
            wt = _mul_rn(_f16_lo(dm), q.to(tl.float32), EXACT) + _f16_lo(dm >> 16)
        else:
            dm = tl.load(w32 + r4 + K // 8 + u // 8)
            scmn = tl.load(u16 + 2 * r4 + K // 4 + K // 128 + u).to(tl.int32)
            dsc = _mul_rn(_f16_lo(dm), (scmn & 255).to(tl.float32), EXACT)
            dmn = _mul_rn(_f16_lo(dm >> 16), ((scmn >> 8) & 255).to(tl.float32), EXACT)
            wt = _mul_rn(dsc, q.to(tl.float32), EXACT) - dmn
    return tl.reshape(wt, (BN, BK))


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, N, row_words, K: tl.constexpr, QTYPE: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, EXACT: tl.constexpr):
    """``BN`` rows x ``BK`` inputs per program -> ``out [N, K]`` in its dtype."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BK
    rows = pid_n * BN + tl.arange(0, BN)
    rw = tl.minimum(rows, N - 1).to(tl.int64) * row_words
    wt = _dequant_tile(w_ptr, rw, k0, K, QTYPE, BN, BK, EXACT)
    dst = out_ptr + rows.to(tl.int64)[:, None] * K + k0 + tl.arange(0, BK)[None, :]
    tl.store(dst, wt.to(out_ptr.dtype.element_ty), mask=(rows < N)[:, None])


# --------------------------------------------------------------------------------------------
# 3 <= M <= GEMM_MAX_M: tl.dot over tiles dequantized in registers


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, x_stride, out_stride, row_words, split_stride,
                 K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # programs sharing a weight tile run side by side
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.minimum(rows, N - 1).to(tl.int64) * row_words
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * x_stride + offs_k[None, :]
    KS: tl.constexpr = K // SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, KS, BLOCK_K):
        k0 = pid_k * KS + kk
        a = tl.load(x_rows + k0)
        wt = _dequant_tile(w_ptr, rw, k0, K, QTYPE, BLOCK_N, BLOCK_K, False)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), tl.trans(wt), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(wt.to(a.dtype)))
    out = out_ptr + pid_k * split_stride + offs_m.to(tl.int64)[:, None] * out_stride + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (rows < N)[None, :])


# --------------------------------------------------------------------------------------------
# launch


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count if torch.cuda.is_available() else 132


#: up to this many activation rows the GEMV runs (two rows a program), then the tl.dot GEMM up to
#: ``GEMM_MAX_M`` (per type where measured), then dequantize + cuBLAS.
GEMV_MAX_M = 2
GEMM_MAX_M: dict[int, int] = {}
GEMM_MAX_M_DEFAULT = 128


def _units(qtype: int, k: int) -> int:
    return k // (64 if qtype == Q6_K else 16 if qtype == Q8_0 else 32)


def gemv_config(qtype: int, m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(BN, NU, SPLIT, num_warps) of the GEMV: the one place to tune it (``benchmarks/bench_kernels.py --sweep``).

    ``NU`` units a step are spread over 32 threads (several units a thread where NU > 32), the
    rest of the 4 warps over rows; K is split over programs only while the grid is under 2
    programs an SM.
    """
    units = _units(qtype, k)
    nu = 64 if units % 64 == 0 and qtype != Q6_K else 32
    bn = 4
    programs = -(-n // bn) * -(-m // 2)
    split = 1
    if programs < 2 * sms:
        want = -(-2 * sms // programs)
        split = max(s for s in range(1, min(want, units) + 1) if units % s == 0)
    return bn, nu, split, 4


def gemm_config(qtype: int, m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages) of the tl.dot GEMM."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = 64
    bk = 128 if qtype != Q6_K else 128
    while k % bk:
        bk //= 2
    tiles = -(-n // bn) * -(-m // bm)
    split = 1
    steps = k // bk
    if tiles < sms:
        want = -(-sms // tiles)
        split = max(s for s in range(1, min(want, steps) + 1) if steps % s == 0)
    return bm, bn, bk, split, 4, 3


def dequantize_blocks(packed: torch.Tensor, qtype: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Planes ``uint8 [n, packed_row_bytes]`` -> ``dtype [n, k]`` with one Triton kernel."""
    n = packed.shape[0]
    dense = torch.empty(n, k, dtype=dtype, device=packed.device)
    bk = 256 if k % 256 == 0 else 32
    _dequant_kernel[(triton.cdiv(n, 16), k // bk)](packed, dense, n, packed.shape[1] // 4, K=k, QTYPE=qtype, BN=16,
                                                   BK=bk, EXACT=not _INTERPRETED, num_warps=4)
    return dense


def _finish(partial: torch.Tensor, target: torch.Tensor) -> None:
    if target.is_contiguous():
        torch.sum(partial, 0, out=target)
    else:
        target.copy_(partial.sum(0))


def gguf_matmul(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int,
                out: torch.Tensor | None = None, col0: int = 0, path: str | None = None,
                config: tuple | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T`` for ``W`` held as ``packed`` (``formats.pack``'s planes of its GGUF
    blocks of ``qtype``).

    Writes columns ``col0 .. col0 + n`` of ``out`` (``[M, >= col0 + n]``, x's dtype, last dim
    contiguous) when given, else a new ``[M, n]`` tensor; returns the ``[M, n]`` view. ``path``
    (``gemv``, ``gemm``, ``dense``) and ``config`` override the choice (benchmarks, tests).
    No host synchronisation: graph-safe.
    """
    assert qtype in KEPT and packed.dtype == torch.uint8 and x.dim() == 2
    m, k = x.shape
    assert packed.shape[1] == packed_row_bytes(qtype, k), "weights must be in formats.pack's layout"
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        col0 = 0
    target = out[:, col0:col0 + n]
    if m == 0:
        return target
    if path is None:
        path = ("gemv" if m <= GEMV_MAX_M else "gemm" if m <= GEMM_MAX_M.get(qtype, GEMM_MAX_M_DEFAULT)
                else "dense")
    sms = _sm_count(x.device.index or 0) if x.is_cuda else 132
    row_words = packed.shape[1] // 4
    if path == "dense":
        dense = dequantize_blocks(packed, qtype, k, x.dtype)
        if target.is_contiguous():
            torch.mm(x, dense.t(), out=target)
        else:
            target.copy_(torch.mm(x, dense.t()))
        return target
    if path == "gemv":
        bn, nu, split, warps = config or gemv_config(qtype, m, n, k, sms)
        grid = (triton.cdiv(n, bn), split, triton.cdiv(m, 2))
        args = dict(K=k, QTYPE=qtype, BLOCK_M=min(m, 2), BN=bn, NU=nu, SPLIT=split, USE_ASM=not _INTERPRETED,
                    num_warps=warps)
        if split == 1:
            _gemv_kernel[grid](x, packed, target, m, n, x.stride(0), out.stride(0), row_words, 0, **args)
        else:  # partial sums per split, added in a fixed order: deterministic
            partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
            _gemv_kernel[grid](x, packed, partial, m, n, x.stride(0), n, row_words, m * n, **args)
            _finish(partial, target)
        return target
    bm, bn, bk, split, warps, stages = config or gemm_config(qtype, m, n, k, sms)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    args = dict(K=k, QTYPE=qtype, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                DOT_F32=x.dtype == torch.float32 or _INTERPRETED, num_warps=warps, num_stages=stages)
    if split == 1:
        _gemm_kernel[grid](x, packed, target, m, n, x.stride(0), out.stride(0), row_words, 0, **args)
    else:
        partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        _gemm_kernel[grid](x, packed, partial, m, n, x.stride(0), n, row_words, m * n, **args)
        _finish(partial, target)
    return target


__all__ = ["gguf_matmul", "gemv_config", "gemm_config", "dequantize_blocks", "GEMV_MAX_M", "GEMM_MAX_M",
           "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
