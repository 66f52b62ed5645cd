"""Triton kernels of the large-M path: per-token int8 activation quantization, then an int8 x int8
GEMM with int32 accumulation whose epilogue applies the row and column scales and the bias.

Two launches per linear: ``_quantize_rows_kernel`` (one program per token) and
``_w8a8_gemm_kernel``. The alternative ``w8a8_linear_int_mm`` runs ``torch._int_mm`` (cuBLASLt)
for the GEMM and ``_rescale_kernel`` for the epilogue; ``gemm.LARGE_M_GEMM`` picks one, by
measurement (``benchmarks/bench_kernels.py``).

Numerics reproduce ``gemm.w8a8_reference`` operation for operation: the scale is
``max(absmax / 127, 1e-12)`` and the code ``round_half_even(x / scale)`` clamped to
[-127, 127], both with IEEE-rounded float32 division (``div_rn``; Triton's plain ``/`` is an
approximate division on NVIDIA GPUs); the int32 accumulator is exact; the epilogue is
``((acc * x_scale) * w_scale)`` rounded to the output dtype, then ``+ bias`` in that dtype. Both
launches that hold the epilogue are compiled with ``enable_fp_fusion=False``: in float32 the
compiler would otherwise contract the last product and the bias add into one FMA (one rounding
where the reference has two), and the result would differ from the reference in the last bit.
Shapes decide every launch parameter, nothing is read back from the device, so the launches
can be captured in CUDA graphs. K is a compile-time constant (see ``kernels_w8a16``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns of one row each step of the quantization kernel (its two passes loop over the row).
_QUANT_BLOCK = 4096


@triton.jit
def _round_half_even(v):
    """``torch.round`` for float32 ``|v| < 2**23``, exact on the GPU and under the interpreter
    (libdevice's rint is not available to the interpreter; ``floor(v + 0.5)`` misrounds 0.49999997)."""
    r = tl.floor(v)
    frac = v - r  # exact: r and v share the binade or r is 0
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_scale_ptr, K: tl.constexpr, stride_x,
                          STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        # quantize.INT8_MAX and quantize.MIN_SCALE, as float32 like the reference's.
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 127.0), 1e-12)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + cols < K
        x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        # Clamping to +-128 first keeps the rounding exact; the result is the same as
        # clamping after rounding, which is what the reference does.
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -128.0), 128.0)
        q = tl.minimum(tl.maximum(_round_half_even(v), -127.0), 127.0)
        tl.store(q_ptr + row * K + k0 + cols, q.to(tl.int8), mask=mask)


def quantize_per_token(x2d: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: ``x2d [M, K]`` to ``(q [M, K] int8, scale [M] float32)``.

    ``input_scale`` (a one-element float32 tensor) is the static per-tensor scale of a
    checkpoint; without it each token gets ``absmax / 127``.
    """
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m, k = x2d.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x2d.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x2d.device)
    if m == 0:
        return q, scale
    block = min(triton.next_power_of_2(k), _QUANT_BLOCK)
    static = input_scale is not None
    _quantize_rows_kernel[(m,)](x2d, q, scale, input_scale if static else scale, k, x2d.stride(0),
                                STATIC=static, BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return q, scale


@triton.jit
def _w8a8_gemm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K: tl.constexpr,
                      stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped tile order: GROUP_M row tiles share each column tile while it is in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Both operands are K-major ([M, K] and [N, K] row-major), the layout int8 MMAs want.
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + rk < K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_mask[None, :], other=0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & (rn[None, :] < N), other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    a_scale = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)
    _store_rescaled(acc, a_scale, w_scale, bias_ptr, out_ptr, rm, rn, M, N, stride_om, HAS_BIAS)


@triton.jit
def _store_rescaled(acc, a_scale, w_scale, bias_ptr, out_ptr, rm, rn, M, N, stride_om, HAS_BIAS: tl.constexpr):
    y = ((acc.to(tl.float32) * a_scale[:, None]) * w_scale[None, :]).to(out_ptr.dtype.element_ty)
    if HAS_BIAS:
        b = tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
        y = (y.to(tl.float32) + b.to(tl.float32)).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm_config(m: int, n: int, sms: int) -> dict[str, int]:
    """Tile sizes from the shape alone. 128x128 tiles with K steps of 128 int8 are the usual
    sm90 choice; when they would leave SMs idle (M in the low hundreds) the row tile halves."""
    block_m = 128 if triton.cdiv(m, 128) * triton.cdiv(n, 128) >= sms else 64
    return {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
            "num_warps": 8 if block_m == 128 else 4, "num_stages": 4}


def w8a8_gemm(qx: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype, sms: int,
              config: dict[str, int] | None = None) -> torch.Tensor:
    """``qx [M, K] int8 @ weight [N, K] int8 .T`` rescaled by ``x_scale [M]`` and ``weight_scale [N]``;
    ``config`` overrides ``gemm_config`` (benchmarks/bench_kernels.py --sweep)."""
    m, k = qx.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=qx.device)
    if m == 0:
        return out
    cfg = config or gemm_config(m, n, sms)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _w8a8_gemm_kernel[grid](qx, weight, x_scale, weight_scale, bias if bias is not None else weight_scale,
                            out, m, n, k, out.stride(0), HAS_BIAS=bias is not None, enable_fp_fusion=False, **cfg)
    return out


def w8a8_linear_triton(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, input_scale: torch.Tensor | None, sms: int) -> torch.Tensor:
    """Two launches: quantize the activations, then the int8 GEMM with the rescale in its epilogue."""
    qx, x_scale = quantize_per_token(x2d, input_scale)
    return w8a8_gemm(qx, x_scale, weight, weight_scale, bias, x2d.dtype, sms)


@triton.jit
def _rescale_kernel(acc_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, stride_acc, stride_om,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    acc = tl.load(acc_ptr + rm[:, None].to(tl.int64) * stride_acc + rn[None, :], mask=mask, other=0)
    a_scale = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)
    _store_rescaled(acc, a_scale, w_scale, bias_ptr, out_ptr, rm, rn, M, N, stride_om, HAS_BIAS)


def w8a8_linear_int_mm(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, input_scale: torch.Tensor | None) -> torch.Tensor:
    """Three launches: quantize, ``torch._int_mm`` (M > 16; K, N multiples of 8), fused rescale."""
    qx, x_scale = quantize_per_token(x2d, input_scale)
    acc = torch._int_mm(qx, weight.t())  # weight.t(): the column-major [K, N] operand, no copy
    m, n = acc.shape
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    grid = (triton.cdiv(m, 32), triton.cdiv(n, 128))
    _rescale_kernel[grid](acc, x_scale, weight_scale, bias if bias is not None else weight_scale, out, m, n,
                          acc.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=32, BLOCK_N=128,
                          enable_fp_fusion=False)
    return out

