"""Activation quantization fused into the layers that produce the activations.

At token counts where a per-channel fp8 linear multiplies fp8 by fp8 (above
``gemm.WEIGHT_ONLY_MAX_M``), its input would otherwise be quantized per token in a launch of its
own. Instead the producing layer does it on the way out:

- ``rms_norm_quant``: RMSNorm (with the residual add) whose output row is quantized in the same
  program (the row is in registers: its absolute maximum is one reduction);
- ``silu_and_mul_quant``: SiLU-and-mul, quantized in the same program (the row in registers up
  to ``SINGLE_PASS_MAX_D``; wider rows take two passes, the second re-reading gate/up from L2).

Dividing each value by its row's scale is most of their arithmetic: they multiply by the scale's
reciprocal and correct the product with two fmas (``kernels._div_rn``), which rounds as IEEE division does.
On an H200 at 8,192 x 14,336 (2026-11-29, CUDA-graph timing) the SiLU-and-mul quantization takes
161 us at 32 warps against 229 us with ``tl.math.div_rn`` at 16 warps (137 us reads gate/up and writes
the codes at 4.29 TB/s).

Both round exactly where the unfused layers (``engine_platform_cuda.kernels``) round, then
quantize with the maths of ``kernels.quantize_per_token_triton``, so the fp8 codes and scales are
bit-identical to the unfused path's. ``Fp8ActivationQuantizer`` is what ``Fp8LinearMethod``
offers the layer SDK (``engine.layers.quantization.ActivationQuantizer``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from engine.layers.quantization import ActivationQuantizer, QuantizedActivation

from engine_quant_fp8 import gemm
from engine_quant_fp8.kernels import _div_rn
from engine_quant_fp8.quantize import _MIN_SCALE, FP8_DTYPE, FP8_MAX


@triton.jit
def _quantize_row(v, mask, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    # v: float32 values of one token's row (masked lanes hold 0).
    amax = tl.max(tl.where(mask, tl.abs(v), 0.0), axis=0)
    scale = tl.maximum(amax / QMAX, MIN_SCALE)
    return tl.clamp(_div_rn(v, scale), -QMAX, QMAX), scale


@triton.jit
def _rmsnorm_quant_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, stride_x, stride_r, n_cols, eps,
                          HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                          QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # added in the activation dtype
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    h = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype).to(tl.float32)
    q, scale = _quantize_row(out, mask, QMAX, MIN_SCALE)
    tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _silu_y(x_ptr, row, stride_x, cols, mask, d: tl.constexpr):
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the activation dtype
    return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, d: tl.constexpr, BLOCK: tl.constexpr,
                           QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if BLOCK >= d:
        # The whole row in registers: one read of gate/up, one write of the codes.
        mask = offs < d
        y = _silu_y(x_ptr, row, stride_x, offs, mask, d)
        q, scale = _quantize_row(y, mask, QMAX, MIN_SCALE)
        tl.store(q_ptr + row * d + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)
    else:
        # Rows too wide for registers: the absolute maximum first, then the codes (re-reading
        # gate/up, mostly from L2).
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(0, d, BLOCK):
            mask = c + offs < d
            amax = tl.maximum(amax, tl.where(mask, tl.abs(_silu_y(x_ptr, row, stride_x, c + offs, mask, d)), 0.0))
        scale = tl.maximum(tl.max(amax, axis=0) / QMAX, MIN_SCALE)
        tl.store(s_ptr + row, scale)
        for c in range(0, d, BLOCK):
            mask = c + offs < d
            y = _silu_y(x_ptr, row, stride_x, c + offs, mask, d)
            q = tl.clamp(_div_rn(y, scale), -QMAX, QMAX)
            tl.store(q_ptr + row * d + c + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


#: Widest SiLU-and-mul row (``d``) quantized from registers in one pass (Llama-3-8B: 14336).
SINGLE_PASS_MAX_D = 16384
#: Block of the two-pass kernel for wider rows.
TWO_PASS_BLOCK = 4096


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   qdtype: torch.dtype = FP8_DTYPE, qmax: float = FP8_MAX
                   ) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
    """``RMSNorm(x [+ residual])`` quantized per token (``qdtype`` codes, ``[M, 1]`` scales); with
    ``residual`` also returns ``x + residual`` like ``RMSNorm.forward``."""
    x2 = _rows(x)
    m, n = x2.shape
    q = torch.empty((m, n), dtype=qdtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x2) if residual is not None else None
    r2 = _rows(residual) if residual is not None else x2
    if m:
        block = triton.next_power_of_2(n)
        _rmsnorm_quant_kernel[(m,)](x2, r2, weight, q, scale, res_out if res_out is not None else x2,
                                    x2.stride(0), r2.stride(0), n, eps, HAS_RESIDUAL=residual is not None,
                                    BLOCK=block, QMAX=qmax, MIN_SCALE=_MIN_SCALE,
                                    num_warps=min(max(block // 256, 1), 16))
    out = QuantizedActivation(q, scale, x.dtype)
    return out if res_out is None else (out, res_out.view(x.shape))


def silu_and_mul_quant(x: torch.Tensor, qdtype: torch.dtype = FP8_DTYPE, qmax: float = FP8_MAX,
                       block: int | None = None, num_warps: int | None = None) -> QuantizedActivation:
    """``silu(x[:, :d]) * x[:, d:]`` quantized per token (``block``, ``num_warps``: launch overrides
    for benchmarks; a block below ``d``'s power of two takes the two-pass kernel)."""
    x2 = _rows(x)
    m, d = x2.shape[0], x2.shape[1] // 2
    q = torch.empty((m, d), dtype=qdtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        if block is None:
            block = triton.next_power_of_2(d)
            if block > SINGLE_PASS_MAX_D:
                block = TWO_PASS_BLOCK
        # Up to 32 warps (Llama-3-8B's 14,336-wide rows: 16 values a thread, two rows resident an SM).
        # H200, 8,192 rows: 161 us at 32 warps, 168 at 16, 180 at 8 (1,024 rows: 25.5 / 27.0 / 28.6).
        _silu_mul_quant_kernel[(m,)](x2, q, scale, x2.stride(0), d, BLOCK=block, QMAX=qmax, MIN_SCALE=_MIN_SCALE,
                                     num_warps=num_warps or min(max(block // 512, 4), 32))
    return QuantizedActivation(q, scale, x.dtype)


class Fp8ActivationQuantizer(ActivationQuantizer):
    """Per-token dynamic fp8 activations for a per-channel fp8 linear, produced by its producer,
    at the token counts where the linear runs an fp8 x fp8 GEMM (CUDA, compute capability 8.9+)."""

    def wants(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.numel() // x.shape[-1] > gemm.WEIGHT_ONLY_MAX_M and gemm.on_fp8_cuda(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
                 ) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
        return rms_norm_quant(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> QuantizedActivation:
        return silu_and_mul_quant(x)
