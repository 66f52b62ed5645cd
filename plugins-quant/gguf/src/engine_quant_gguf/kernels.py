"""Triton kernels for GGUF weights on CUDA: ``y[m, n] = sum_k x[m, k] * W[n, k]`` with ``W`` held
in ``formats.pack``'s layout (the GGUF bytes regrouped per row so codes are int32-aligned).

- ``_rows_kernel`` (M < ``DENSE_MIN_M``, decode): each thread owns ``R`` weight rows and loads 4
  consecutive code words (16 bytes) of each per step; every multiply and sum stays inside the
  thread (no shuffles, no layout conversions), the activations of a step are the same for all
  threads, and the block scale (and min) is applied per sub-block to the sums:
  ``y += d*sc * sum(x*q) - dmin*m * sum(x)``. Codes become floats by the exponent trick
  (``(q | 0x4B000000)`` as float32 minus 2**23). K is split across programs (``SPLIT_K``) until
  the grid fills the GPU; the float32 partial sums are added in a fixed order (deterministic).
- ``_dequant_kernel`` + ``torch.mm`` (M >= ``DENSE_MIN_M``): the weight is dequantized into a
  scratch tensor of the activation dtype (the float operations of ``formats.dequantize``, so
  bit-identical before the cast) and multiplied by cuBLAS, as vLLM does for GGUF at large M.

Both write ``out[:, col0:col0 + N]`` of a wider output (so the shards of a fused layer with
different types fill one tensor). No host synchronisation: CUDA-graph safe. A "unit" is 256
elements of a row: one super-block for Q4_K/Q6_K, eight 32-element blocks for Q4_0/Q4_1/Q8_0
(the last unit of a row may be partial for those; the loads are masked).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine_quant_gguf.formats import KEPT, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, packed_row_bytes


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
# M < DENSE_MIN_M: the rows kernel. Tensors are [BLOCK_M, R, T, 4]: T = 32 * num_warps threads
# side by side, R weight rows per thread, 4 consecutive code words (one 16-byte load) per row,
# BLOCK_M activation rows. Every product and sum happens inside a thread (no shuffles, no layout
# conversions); the activations of a group of 4 words are the same for all threads (broadcast
# loads) and serve R rows; each row's sums are reduced once, at the end.


@triton.jit
def _f16_bits(bits):
    """float16 bit pattern in the low 16 bits of an int32 -> float32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _rows_kernel(x_ptr, w_ptr, out_ptr, M, N, row_words, x_stride, out_stride, split_stride, K: tl.constexpr,
                 QTYPE: tl.constexpr, UNITS: tl.constexpr, BLOCK_M: tl.constexpr, R: tl.constexpr,
                 T: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * (R * T) + tl.arange(0, R)[:, None] * T + tl.arange(0, T)[None, :]     # [R, T]
    # Rows past N read row N-1 (valid memory, result dropped): no masks on the hot loads.
    rb = (tl.minimum(rows, N - 1).to(tl.int64) * row_words)[None, :, :, None]             # [1, R, T, 1] words
    kk = tl.arange(0, 4)[None, None, None, :]                                              # [1, 1, 1, 4]
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    xrow = (tl.minimum(ms, M - 1).to(tl.int64) * x_stride)[:, None, None, None]            # [BLOCK_M, 1, 1, 1]
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    i8 = w_ptr.to(tl.pointer_type(tl.int8))
    f16 = w_ptr.to(tl.pointer_type(tl.float16))
    acc = tl.zeros([BLOCK_M, R, T, 4], dtype=tl.float32)
    u0 = pid_k * UNITS
    if QTYPE == 12:  # Q4_K: 36 words a super-block: d|dmin, 3 of scales, 32 of codes
        for i in range(UNITS):
            u = u0 + i
            sb = w32 + rb + u * 36
            h0 = tl.load(sb)
            h1 = tl.load(sb + 1)
            h2 = tl.load(sb + 2)
            h3 = tl.load(sb + 3)
            d = _f16_bits(h0)
            dmin = _f16_bits(h0 >> 16)
            for j in tl.static_range(4):  # sub-blocks 2j (low nibbles) and 2j+1 (high)
                if j < 2:
                    sc_lo = (h1 >> (16 * j)) & 63
                    mn_lo = (h2 >> (16 * j)) & 63
                    sc_hi = (h1 >> (16 * j + 8)) & 63
                    mn_hi = (h2 >> (16 * j + 8)) & 63
                else:
                    t0 = 16 * (j - 2)
                    sc_lo = ((h3 >> t0) & 15) | (((h1 >> (t0 + 6)) & 3) << 4)
                    mn_lo = ((h3 >> (t0 + 4)) & 15) | (((h2 >> (t0 + 6)) & 3) << 4)
                    sc_hi = ((h3 >> (t0 + 8)) & 15) | (((h1 >> (t0 + 14)) & 3) << 4)
                    mn_hi = ((h3 >> (t0 + 12)) & 15) | (((h2 >> (t0 + 14)) & 3) << 4)
                dsc_lo = d * sc_lo.to(tl.float32)
                dsc_hi = d * sc_hi.to(tl.float32)
                dm_lo = dmin * mn_lo.to(tl.float32)
                dm_hi = dmin * mn_hi.to(tl.float32)
                for half in tl.static_range(2):
                    words = tl.load(sb + 4 + 8 * j + 4 * half + kk)                        # [1, R, T, 4]
                    xc = x_ptr + xrow + u * 256 + 64 * j + 16 * half + 4 * kk              # element of byte 0
                    s_lo = tl.zeros([BLOCK_M, R, T, 4], dtype=tl.float32)
                    s_hi = tl.zeros([BLOCK_M, R, T, 4], dtype=tl.float32)
                    xs_lo = tl.zeros([BLOCK_M, 1, 1, 4], dtype=tl.float32)
                    xs_hi = tl.zeros([BLOCK_M, 1, 1, 4], dtype=tl.float32)
                    for b in tl.static_range(4):
                        x_lo = tl.load(xc + b).to(tl.float32)                               # [BLOCK_M, 1, 1, 4]
                        x_hi = tl.load(xc + 32 + b).to(tl.float32)
                        s_lo += _to_f32((words >> (8 * b)) & 15) * x_lo
                        s_hi += _to_f32((words >> (8 * b + 4)) & 15) * x_hi
                        xs_lo += x_lo
                        xs_hi += x_hi
                    acc += dsc_lo * s_lo + dsc_hi * s_hi - dm_lo * xs_lo - dm_hi * xs_hi
    elif QTYPE == 14:  # Q6_K (packed): ql [K/8 words], qh [K/16 words], scales int8, d f16
        for i in range(UNITS):
            u = u0 + i
            d = tl.load(f16 + 2 * rb + (3 * K) // 8 + K // 32 + u).to(tl.float32)         # [1, R, T, 1]
            for hg in tl.static_range(4):  # element 128h + 32t + 16g + 4w + b, hg = 2h + g
                h = hg // 2
                g = hg % 2
                ql0 = tl.load(w32 + rb + 32 * u + 16 * h + 4 * g + kk)
                ql1 = tl.load(w32 + rb + 32 * u + 16 * h + 8 + 4 * g + kk)
                qh = tl.load(w32 + rb + K // 8 + 16 * u + 8 * h + 4 * g + kk)
                for t in tl.static_range(4):
                    if t % 2 == 0:
                        lw = ql0
                    else:
                        lw = ql1
                    sc = tl.load(i8 + 4 * rb + (3 * K) // 4 + 16 * u + 8 * h + 2 * t + g).to(tl.float32)
                    xc = x_ptr + xrow + u * 256 + 128 * h + 32 * t + 16 * g + 4 * kk
                    s = tl.zeros([BLOCK_M, R, T, 4], dtype=tl.float32)
                    xs = tl.zeros([BLOCK_M, 1, 1, 4], dtype=tl.float32)
                    for b in tl.static_range(4):
                        xv = tl.load(xc + b).to(tl.float32)
                        q = ((lw >> (8 * b + 4 * (t // 2))) & 15) | (((qh >> (8 * b + 2 * t)) & 3) << 4)
                        s += _to_f32(q) * xv
                        xs += xv
                    acc += (d * sc) * (s - 32.0 * xs)
    else:  # Q4_0 / Q4_1 / Q8_0 (packed): codes, then d (then m); 8 blocks of 32 a unit
        NB: tl.constexpr = K // 32
        WPB: tl.constexpr = 8 if QTYPE == 8 else 4                                         # code words a block
        for i in range(UNITS * 8):  # one 32-element block an iteration (a static unroll spills registers)
            blk = 8 * u0 + i
            ok = blk < NB
            d = tl.load(f16 + 2 * rb + (WPB * NB) * 2 + blk, mask=ok, other=0.0).to(tl.float32)
            if QTYPE == 8:
                for half in tl.static_range(2):
                    words = tl.load(w32 + rb + WPB * blk + 4 * half + kk, mask=ok, other=0) ^ -2139062144
                    xc = x_ptr + xrow + 32 * blk + 16 * half + 4 * kk
                    s = tl.zeros([BLOCK_M, R, T, 4], dtype=tl.float32)
                    xs = tl.zeros([BLOCK_M, 1, 1, 4], dtype=tl.float32)
                    for b in tl.static_range(4):
                        xv = tl.load(xc + b, mask=ok, other=0.0).to(tl.float32)
                        s += _to_f32((words >> (8 * b)) & 255) * xv                    # q + 128
                        xs += xv
                    acc += d * (s - 128.0 * xs)
            else:
                words = tl.load(w32 + rb + WPB * blk + kk, mask=ok, other=0)
                xc = x_ptr + xrow + 32 * blk + 4 * kk
                s = tl.zeros([BLOCK_M, R, T, 4], dtype=tl.float32)
                xs = tl.zeros([BLOCK_M, 1, 1, 4], dtype=tl.float32)
                for b in tl.static_range(4):
                    x_lo = tl.load(xc + b, mask=ok, other=0.0).to(tl.float32)
                    x_hi = tl.load(xc + 16 + b, mask=ok, other=0.0).to(tl.float32)
                    s += _to_f32((words >> (8 * b)) & 15) * x_lo + _to_f32((words >> (8 * b + 4)) & 15) * x_hi
                    xs += x_lo + x_hi
                if QTYPE == 2:
                    acc += d * (s - 8.0 * xs)
                else:
                    mn = tl.load(f16 + 2 * rb + (WPB * NB) * 2 + NB + blk, mask=ok, other=0.0).to(tl.float32)
                    acc += d * s + mn * xs
    res = tl.sum(acc, axis=3)                                                               # [BLOCK_M, R, T]
    out = out_ptr + pid_k * split_stride + ms.to(tl.int64)[:, None, None] * out_stride + rows[None, :, :]
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=(ms < M)[:, None, None] & (rows < N)[None, :, :])


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
DENSE_MIN_M_DEFAULT = 3


def rows_config(qtype: int, m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, R, SPLIT_K, num_warps) of the rows kernel: the one place to tune it.

    A program covers ``R * 32 * num_warps`` weight rows; K is split (partial sums added in a
    fixed order) until the grid has about 4 programs per SM.
    """
    units = -(-k // 256)
    block_m = min(m, 2)  # BLOCK_M 4 spills registers (ptxas) and ran 7x slower than 2 on the H100
    r = 2 if m == 1 and qtype != Q6_K else 1  # R = 2 at M = 2 (and Q6_K) spills on the larger K splits
    warps = 4
    tiles = -(-n // (r * 32 * warps)) * -(-m // block_m)
    split = 1
    if tiles < 4 * sms:
        want = -(-4 * sms // tiles)
        split = max(s for s in range(1, min(want, units) + 1) if units % s == 0)
    return block_m, r, split, warps


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
    M < ``DENSE_MIN_M``: the rows kernel (weights read once per ``BLOCK_M`` activation rows); else dequantize
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
    block_m, r, split, warps = rows_config(qtype, m, n, k, sms)
    units = -(-k // 256)
    grid = (triton.cdiv(n, r * 32 * warps), split, triton.cdiv(m, block_m))
    row_words = packed.shape[1] // 4
    if split == 1:
        _rows_kernel[grid](x, packed, target, m, n, row_words, x.stride(0), out.stride(0), 0, K=k, QTYPE=qtype,
                           UNITS=units, BLOCK_M=block_m, R=r, T=32 * warps, num_warps=warps)
    else:  # partial sums per split, added in a fixed order: deterministic, graph-safe
        partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        _rows_kernel[grid](x, packed, partial, m, n, row_words, x.stride(0), n, m * n, K=k, QTYPE=qtype,
                           UNITS=units // split, BLOCK_M=block_m, R=r, T=32 * warps, num_warps=warps)
        if target.is_contiguous():
            torch.sum(partial, 0, out=target)
        else:
            target.copy_(partial.sum(0))
    return target


__all__ = ["gguf_matmul", "rows_config", "dequantize_blocks", "DENSE_MIN_M", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
