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

from engine_quant_gguf.formats import KEPT, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0

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
# M = 1


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, row_bytes, out_stride_split,
                 K: tl.constexpr, UNITS: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    # K and the units per program are compile-time: loops of known trip count (and Triton's
    # interpreter cannot loop over run-time bounds under numpy 2).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    # Rows past N read row N-1 (valid memory, result dropped): no masks on the hot loads.
    row_off = tl.minimum(rows, N - 1).to(tl.int64) * row_bytes
    u_start = pid_k * UNITS
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if QTYPE == 12:  # Q4_K: super-block of 144 bytes
        j = tl.arange(0, 4)
        l = tl.arange(0, 32)
        q_cols = 16 + 32 * j[:, None] + l[None, :]  # [4, 32] byte offsets of qs in a super-block
        x_cols = 64 * j[:, None] + l[None, :]        # element of a low nibble; +32 for the high one
        for i_u in range(UNITS):
            u = u_start + i_u
            sb = row_off[:, None] + u * 144                        # [BLOCK_N, 1]
            d = _load_f16(w_ptr, sb)                          # [BLOCK_N, 1]
            dmin = _load_f16(w_ptr, sb + 2)
            sc_lo, mn_lo = _q4k_scale_min(w_ptr, sb, 2 * j[None, :])       # [BLOCK_N, 4]
            sc_hi, mn_hi = _q4k_scale_min(w_ptr, sb, 2 * j[None, :] + 1)
            qs = tl.load(w_ptr + sb[:, :, None] + q_cols[None, :, :]).to(tl.int32)  # [BLOCK_N, 4, 32]
            x_lo = tl.load(x_ptr + u * 256 + x_cols).to(tl.float32)               # [4, 32]
            x_hi = tl.load(x_ptr + u * 256 + 32 + x_cols).to(tl.float32)
            s_lo = tl.sum(_to_f32(qs & 15) * x_lo[None, :, :], axis=2)            # [BLOCK_N, 4]
            s_hi = tl.sum(_to_f32(qs >> 4) * x_hi[None, :, :], axis=2)
            part = d * (sc_lo * s_lo + sc_hi * s_hi) - dmin * (mn_lo * tl.sum(x_lo, axis=1)[None, :]
                                                             + mn_hi * tl.sum(x_hi, axis=1)[None, :])
            acc += tl.sum(part, axis=1)
    elif QTYPE == 14:  # Q6_K: super-block of 210 bytes; element 128h + 32t + 16g + i
        h = tl.arange(0, 2)[:, None, None]
        g = tl.arange(0, 2)[None, :, None]
        i = tl.arange(0, 16)[None, None, :]
        pos = 16 * g + i                                             # l in 0..31, [1, 2, 16]
        h2 = tl.arange(0, 2)[:, None]
        g2 = tl.arange(0, 2)[None, :]
        for i_u in range(UNITS):
            u = u_start + i_u
            sb = row_off[:, None, None, None] + u * 210              # [BLOCK_N, 1, 1, 1]
            sb3 = row_off[:, None, None] + u * 210                   # [BLOCK_N, 1, 1]
            d = _load_f16(w_ptr, row_off + u * 210 + 208)     # [BLOCK_N]
            ql0 = tl.load(w_ptr + sb + (64 * h + pos)[None]).to(tl.int32)        # [BLOCK_N, 2, 2, 16]
            ql1 = tl.load(w_ptr + sb + (64 * h + 32 + pos)[None]).to(tl.int32)
            qh = tl.load(w_ptr + sb + (128 + 32 * h + pos)[None]).to(tl.int32)
            part = tl.zeros([BLOCK_N, 2, 2], dtype=tl.float32)
            for t in tl.static_range(4):
                if t == 0:
                    lowbits = ql0 & 15
                elif t == 1:
                    lowbits = ql1 & 15
                elif t == 2:
                    lowbits = ql0 >> 4
                else:
                    lowbits = ql1 >> 4
                q = lowbits | (((qh >> (2 * t)) & 3) << 4)
                xv = tl.load(x_ptr + u * 256 + 128 * h + 32 * t + pos).to(tl.float32)   # [2, 2, 16]
                s = tl.sum(_to_f32(q) * xv[None], axis=3) - 32.0 * tl.sum(xv, axis=2)[None]  # [BLOCK_N, 2, 2]
                sc = tl.load((w_ptr + sb3 + 192 + (8 * h2 + 2 * t + g2)[None]).to(tl.pointer_type(tl.int8)))
                part += sc.to(tl.float32) * s
            acc += d * tl.sum(tl.sum(part, axis=2), axis=1)
    else:  # Q4_0 / Q4_1 / Q8_0: eight 32-element blocks per unit
        BYTES: tl.constexpr = 18 if QTYPE == 2 else (20 if QTYPE == 3 else 34)
        n_blocks: tl.constexpr = K // 32
        bi = tl.arange(0, 8)
        for i_u in range(UNITS):
            u = u_start + i_u
            blk = u * 8 + bi                                      # [8]
            ok = blk < n_blocks
            boff = row_off[:, None] + blk[None, :] * BYTES        # [BLOCK_N, 8]
            d = _load_f16_masked(w_ptr, boff, ok[None, :])
            if QTYPE == 8:
                e = tl.arange(0, 32)
                qs = tl.load(w_ptr + boff[:, :, None] + 2 + e[None, None, :], mask=ok[None, :, None], other=0)
                xv = tl.load(x_ptr + blk[:, None] * 32 + e[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
                # int8 codes: (byte ^ 0x80) = q + 128 as an unsigned value
                s = tl.sum(_to_f32(qs.to(tl.int32) ^ 128) * xv[None], axis=2) - 128.0 * tl.sum(xv, axis=1)[None, :]
                acc += tl.sum(d * s, axis=1)
            else:
                QOFF: tl.constexpr = 2 if QTYPE == 2 else 4
                e = tl.arange(0, 16)
                qs = tl.load(w_ptr + boff[:, :, None] + QOFF + e[None, None, :], mask=ok[None, :, None],
                             other=0).to(tl.int32)
                x_lo = tl.load(x_ptr + blk[:, None] * 32 + e[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
                x_hi = tl.load(x_ptr + blk[:, None] * 32 + 16 + e[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
                s = tl.sum(_to_f32(qs & 15) * x_lo[None] + _to_f32(qs >> 4) * x_hi[None], axis=2)  # [BLOCK_N, 8]
                xs = (tl.sum(x_lo, axis=1) + tl.sum(x_hi, axis=1))[None, :]
                if QTYPE == 2:
                    acc += tl.sum(d * (s - 8.0 * xs), axis=1)
                else:
                    m = _load_f16_masked(w_ptr, boff + 2, ok[None, :])
                    acc += tl.sum(d * s + m * xs, axis=1)
    tl.store(out_ptr + pid_k * out_stride_split + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


# --------------------------------------------------------------------------------------------
# M >= 2


@triton.jit
def _dot(acc, x, w, FP32: tl.constexpr):
    # x [BLOCK_M, P] in the activation dtype, w [BLOCK_N, P] float32 (dequantized)
    if FP32:
        return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, row_bytes, x_stride, out_stride, K: tl.constexpr,
                 QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rows_m < M
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = tl.minimum(rows, N - 1).to(tl.int64) * row_bytes
    x_row = x_ptr + rows_m.to(tl.int64)[:, None] * x_stride         # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    N_UNITS: tl.constexpr = (K + 255) // 256
    if QTYPE == 12:  # Q4_K
        j = tl.arange(0, 4)
        l = tl.arange(0, 32)
        q_cols = 16 + 32 * j[:, None] + l[None, :]
        x_cols = tl.reshape(64 * j[:, None] + l[None, :], (128,))
        for u in range(N_UNITS):
            sb = row_off[:, None] + u * 144
            d = _load_f16(w_ptr, sb)
            dmin = _load_f16(w_ptr, sb + 2)
            sc_lo, mn_lo = _q4k_scale_min(w_ptr, sb, 2 * j[None, :])
            sc_hi, mn_hi = _q4k_scale_min(w_ptr, sb, 2 * j[None, :] + 1)
            qs = tl.load(w_ptr + sb[:, :, None] + q_cols[None, :, :]).to(tl.int32)   # [BLOCK_N, 4, 32]
            w_lo = (d * sc_lo)[:, :, None] * (qs & 15).to(tl.float32) - (dmin * mn_lo)[:, :, None]
            w_hi = (d * sc_hi)[:, :, None] * (qs >> 4).to(tl.float32) - (dmin * mn_hi)[:, :, None]
            x_lo = tl.load(x_row + u * 256 + x_cols[None, :], mask=m_ok[:, None], other=0.0)
            x_hi = tl.load(x_row + u * 256 + 32 + x_cols[None, :], mask=m_ok[:, None], other=0.0)
            acc = _dot(acc, x_lo, tl.reshape(w_lo, (BLOCK_N, 128)), FP32)
            acc = _dot(acc, x_hi, tl.reshape(w_hi, (BLOCK_N, 128)), FP32)
    elif QTYPE == 14:  # Q6_K: piece t holds elements 128h + 32t + 16g + i
        h = tl.arange(0, 2)[:, None, None]
        g = tl.arange(0, 2)[None, :, None]
        i = tl.arange(0, 16)[None, None, :]
        pos = 16 * g + i
        for u in range(N_UNITS):
            sb = row_off[:, None, None, None] + u * 210
            d = _load_f16(w_ptr, row_off + u * 210 + 208)[:, None, None, None]
            ql0 = tl.load(w_ptr + sb + (64 * h + pos)[None]).to(tl.int32)
            ql1 = tl.load(w_ptr + sb + (64 * h + 32 + pos)[None]).to(tl.int32)
            qh = tl.load(w_ptr + sb + (128 + 32 * h + pos)[None]).to(tl.int32)
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
                sc = tl.load((w_ptr + sb + 192 + (8 * h + 2 * t + g)[None]).to(tl.pointer_type(tl.int8))).to(tl.float32)
                w = (d * sc) * q.to(tl.float32)
                cols = tl.reshape(128 * h + 32 * t + pos, (64,))
                xv = tl.load(x_row + u * 256 + cols[None, :], mask=m_ok[:, None], other=0.0)
                acc = _dot(acc, xv, tl.reshape(w, (BLOCK_N, 64)), FP32)
    else:  # Q4_0 / Q4_1 / Q8_0
        BYTES: tl.constexpr = 18 if QTYPE == 2 else (20 if QTYPE == 3 else 34)
        n_blocks: tl.constexpr = K // 32
        bi = tl.arange(0, 8)
        for u in range(N_UNITS):
            blk = u * 8 + bi
            ok = blk < n_blocks
            boff = row_off[:, None] + blk[None, :] * BYTES
            d = _load_f16_masked(w_ptr, boff, ok[None, :])[:, :, None]       # [BLOCK_N, 8, 1]
            if QTYPE == 8:
                e = tl.arange(0, 32)
                qs = tl.load((w_ptr + boff[:, :, None] + 2 + e[None, None, :]).to(tl.pointer_type(tl.int8)),
                             mask=ok[None, :, None], other=0)
                w = qs.to(tl.float32) * d
                cols = tl.reshape(blk[:, None] * 32 + e[None, :], (256,))
                xv = tl.load(x_row + cols[None, :], mask=m_ok[:, None] & (cols < K)[None, :], other=0.0)
                acc = _dot(acc, xv, tl.reshape(w, (BLOCK_N, 256)), FP32)
            else:
                QOFF: tl.constexpr = 2 if QTYPE == 2 else 4
                e = tl.arange(0, 16)
                qs = tl.load(w_ptr + boff[:, :, None] + QOFF + e[None, None, :], mask=ok[None, :, None],
                             other=0).to(tl.int32)
                if QTYPE == 2:
                    w_lo = d * ((qs & 15) - 8).to(tl.float32)
                    w_hi = d * ((qs >> 4) - 8).to(tl.float32)
                else:
                    m = _load_f16_masked(w_ptr, boff + 2, ok[None, :])[:, :, None]
                    w_lo = d * (qs & 15).to(tl.float32) + m
                    w_hi = d * (qs >> 4).to(tl.float32) + m
                cols = tl.reshape(blk[:, None] * 32 + e[None, :], (128,))
                c_ok = m_ok[:, None] & (cols < K)[None, :]
                x_lo = tl.load(x_row + cols[None, :], mask=c_ok, other=0.0)
                x_hi = tl.load(x_row + 16 + cols[None, :], mask=c_ok, other=0.0)
                acc = _dot(acc, x_lo, tl.reshape(w_lo, (BLOCK_N, 128)), FP32)
                acc = _dot(acc, x_hi, tl.reshape(w_hi, (BLOCK_N, 128)), FP32)
    out = out_ptr + rows_m.to(tl.int64)[:, None] * out_stride + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (rows < N)[None, :])


# --------------------------------------------------------------------------------------------
# launch


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count if torch.cuda.is_available() else 8


def gemv_config(n: int, k: int, qtype: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, SPLIT_K, num_warps) for M = 1: the one place to tune the decode kernel.

    Aim for at least four programs per SM (enough loads in flight to cover the memory latency)
    with 8-32 rows each; split K when the rows alone give too few programs.
    """
    units = -(-k // 256)
    block_n = 32 if n >= 32 * 4 * sms else (16 if n >= 16 * 4 * sms else 8)
    tiles = -(-n // block_n)
    split = 1
    if tiles < 4 * sms:  # the largest divisor of the units that keeps 4+ units per program
        want = -(-4 * sms // tiles)
        split = max(s for s in range(1, min(want, units // 4) + 1) if units % s == 0) if units >= 4 else 1
    return block_n, split, 4


def gemm_config(m: int, n: int, qtype: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for M >= 2 (tl.dot needs tiles of 16 or more)."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return block_m, 64, 4 if block_m < 64 else 8


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int,
                out: torch.Tensor | None = None, col0: int = 0) -> torch.Tensor:
    """``x [M, K] @ W.T`` for ``W`` stored as ``blocks`` (``uint8 [n, row_bytes]`` of ``qtype``).

    Writes columns ``col0 .. col0 + n`` of ``out`` (``[M, >= col0 + n]``, x's dtype, last dim
    contiguous) when given, else a new ``[M, n]`` tensor; returns the ``[M, n]`` view.
    """
    assert qtype in KEPT and blocks.dtype == torch.uint8 and x.dim() == 2
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        col0 = 0
    target = out[:, col0:col0 + n]
    if m == 0:
        return target
    if m == 1:
        sms = _sm_count(x.device.index or 0) if x.is_cuda else 8
        block_n, split, warps = gemv_config(n, k, qtype, sms)
        units = -(-k // 256)
        grid = (triton.cdiv(n, block_n), split)
        if split == 1:
            _gemv_kernel[grid](x, blocks, target, n, blocks.shape[1], 0, K=k, UNITS=units,
                               QTYPE=qtype, BLOCK_N=block_n, num_warps=warps)
        else:  # partial sums per split, added in a fixed order: deterministic, graph-safe
            partial = torch.empty(split, n, dtype=torch.float32, device=x.device)
            _gemv_kernel[grid](x, blocks, partial, n, blocks.shape[1], n, K=k, UNITS=units // split,
                               QTYPE=qtype, BLOCK_N=block_n, num_warps=warps)
            target.copy_(partial.sum(0, keepdim=True))
        return target
    block_m, block_n, warps = gemm_config(m, n, qtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gemm_kernel[grid](x, blocks, target, m, n, blocks.shape[1], x.stride(0), out.stride(0), K=k,
                       QTYPE=qtype, BLOCK_M=block_m, BLOCK_N=block_n, FP32=x.dtype == torch.float32 or _INTERPRETED,
                       num_warps=warps)
    return target


__all__ = ["gguf_matmul", "gemv_config", "gemm_config", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
