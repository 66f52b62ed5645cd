"""Triton kernels of the small-M (decode) path: weight-only int8, activations left in 16/32 bits.

At a few tokens a linear layer is bound by reading its weight, so this path reads the int8
weight once (half the bytes of bf16), turns it into floats in registers and multiplies it by
the unquantized activations with float32 accumulation. The per-channel scale factors out of
the sum over K and is applied once per output in the epilogue:
``y = (sum_k x[m, k] * w[n, k]) * w_scale[n]``, rounded to the activation dtype, then ``+ bias``.
Numerically this is W8A16 (``gemm.w8a16_reference``), not W8A8.

- ``_gemv_kernel`` (M = 1, see ``gemm.GEMV_MAX_M``): no tensor cores; each program owns
  ``BLOCK_N`` weight rows and streams them along K with wide, coalesced loads.
- ``_dot_kernel`` (M up to ``gemm.WEIGHT_ONLY_MAX_M``): ``tl.dot`` tiles of at least 16 x 16.

Both split K across programs when the output has too few tiles to fill the SMs; the float32
partial sums then go through ``_splitk_reduce_kernel``, which adds them in a fixed order
(deterministic, unlike atomics). Every launch parameter comes from the shapes. K (and the
K range of a split) is a compile-time constant: a model has a handful of distinct K, the
compiler drops the K masks where BLOCK_K divides it, and Triton's interpreter (CPU tests)
cannot run loops whose bounds are runtime arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tile sizes; benchmarks/bench_kernels.py prints the time of each shape so they can be tuned on an H100.
_GEMV_BLOCK_N = 16
_GEMV_BLOCK_K = 512
_DOT_BLOCK_N = 32
_DOT_BLOCK_K = 256  # 16-bit activations; float32 ones take 64 to keep the pipeline in shared memory
_DOT_BLOCK_K_F32 = 64
# A K split keeps at least this many BLOCK_K steps per program (fewer: the reduce dominates).
_MIN_K_STEPS_PER_SPLIT = 2


@triton.jit
def _int8_to_f32(w):
    """Exact int8 -> float32 with integer ops and one subtraction (no I2F, whose throughput on
    sm90 is a quarter of the ALU's and would bound a GEMV): the bits 0x4B000000 | (w + 128) are
    the float 2**23 + 128 + w."""
    bits = w.to(tl.int32) + 0x4B000080
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _epilogue(s, w_scale, bias_ptr, out_ptr, rn, N, HAS_BIAS: tl.constexpr):
    """``s * w_scale`` rounded to the output dtype, then ``+ bias`` in that dtype (as the reference)."""
    y = (s * w_scale).to(out_ptr.dtype.element_ty)
    if HAS_BIAS:
        b = tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
        y = (y.to(tl.float32) + b.to(tl.float32)).to(out_ptr.dtype.element_ty)
    return y


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, M, N, K: tl.constexpr, stride_xm, stride_om,
                 K_PER_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    k_start = pid_k * K_PER_SPLIT
    w_row = w_ptr + rn[:, None].to(tl.int64) * K
    # Elementwise float32 partial products, summed over K once at the end.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        k = k_start + k0 + rk
        k_mask = k < K
        x = tl.load(x_ptr + m * stride_xm + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_row + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
        acc += _int8_to_f32(w) * x[None, :]
    s = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        w_scale = tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)
        y = _epilogue(s, w_scale, bias_ptr, out_ptr, rn, N, HAS_BIAS)
        tl.store(out_ptr + m * stride_om + rn, y, mask=n_mask)
    else:
        tl.store(part_ptr + (pid_k * M + m) * N + rn, s, mask=n_mask)


@triton.jit
def _dot_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, M, N, K: tl.constexpr, stride_xm, stride_om,
                K_PER_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    k_start = pid_k * K_PER_SPLIT
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + rn[None, :].to(tl.int64) * K  # the [BLOCK_K, BLOCK_N] tile of W.T, K-major
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        k = k_start + k0 + rk
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        # int8 codes are exact in bf16/fp16 (8/11 significant bits); float32 activations use
        # full-precision dots, not TF32, so every dtype sums exact products in float32.
        w = _int8_to_f32(w).to(x.dtype)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if SPLIT_K == 1:
        w_scale = tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)
        y = _epilogue(acc, w_scale[None, :], bias_ptr, out_ptr, rn[None, :], N, HAS_BIAS)
        out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out_ptrs, y, mask=m_mask[:, None] & n_mask[None, :])
    else:
        part_ptrs = part_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(part_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _splitk_reduce_kernel(part_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, stride_om,
                          HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
    m = tl.program_id(1).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        s += tl.load(part_ptr + (split * M + m) * N + rn, mask=n_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)
    tl.store(out_ptr + m * stride_om + rn, _epilogue(s, w_scale, bias_ptr, out_ptr, rn, N, HAS_BIAS), mask=n_mask)


def split_k_for(tiles: int, k: int, block_k: int, sms: int) -> int:
    """Doubles the K split while the tiles leave SMs idle and each split keeps enough K steps."""
    split = 1
    while tiles * split < sms and triton.cdiv(k, block_k * split * 2) >= _MIN_K_STEPS_PER_SPLIT:
        split *= 2
    return split


def w8a16_config(m: int, n: int, k: int, gemv: bool, sms: int, dtype: torch.dtype) -> dict[str, int]:
    """Launch parameters of the weight-only path, from the shape alone."""
    if gemv:
        block_m, block_n, block_k = 1, _GEMV_BLOCK_N, _GEMV_BLOCK_K
    else:
        block_m = min(max(16, triton.next_power_of_2(m)), 64)
        block_n, block_k = _DOT_BLOCK_N, _DOT_BLOCK_K_F32 if dtype == torch.float32 else _DOT_BLOCK_K
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = split_k_for(tiles, k, block_k, sms)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 4, "num_stages": 3}


def w8a16_linear_triton(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, gemv: bool, sms: int,
                        config: dict[str, int] | None = None) -> torch.Tensor:
    """``x2d [M, K] @ (weight [N, K] int8 * weight_scale [N]).T + bias`` in ``x2d.dtype``.

    ``gemv`` picks ``_gemv_kernel`` (meant for M = 1) over ``_dot_kernel``; both are correct at any M.
    ``config`` overrides ``w8a16_config`` (benchmarks/bench_kernels.py --sweep tunes with it).
    """
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m, k = x2d.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    if m == 0:
        return out
    cfg = config or w8a16_config(m, n, k, gemv, sms, x2d.dtype)
    split = cfg["SPLIT_K"]
    # Each split covers whole BLOCK_K steps, so only the last one meets the end of K.
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2d.device) if split > 1 else out
    b = bias if bias is not None else weight_scale
    grid_n = triton.cdiv(n, cfg["BLOCK_N"])
    if gemv:
        _gemv_kernel[(grid_n, split, m)](x2d, weight, weight_scale, b, out, part, m, n, k, x2d.stride(0),
                                         out.stride(0), k_per_split, HAS_BIAS=bias is not None, SPLIT_K=split,
                                         BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"])
    else:
        grid = (grid_n, split, triton.cdiv(m, cfg["BLOCK_M"]))
        _dot_kernel[grid](x2d, weight, weight_scale, b, out, part, m, n, k, x2d.stride(0), out.stride(0),
                          k_per_split, HAS_BIAS=bias is not None, SPLIT_K=split,
                          IEEE=x2d.dtype == torch.float32, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                          BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(n, 256), m)](part, weight_scale, b, out, m, n, out.stride(0),
                                                        HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_N=256)
    return out
