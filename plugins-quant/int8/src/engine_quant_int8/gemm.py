"""The int8 linear: a weight-only path for a few tokens, W8A8 for many; Triton on CUDA, torch on CPU.

``int8_linear`` picks the path by the number of tokens M (a shape, so each CUDA graph
captures one path):

- M <= ``WEIGHT_ONLY_MAX_M`` (decode): ``w8a16_linear``. The int8 weight is turned into floats
  and multiplied by the activations as they are (bf16/fp16/fp32), float32 accumulation. Reading
  the weight is the cost at small M, and quantizing the activations would only add a launch.
- larger M (prefill): ``w8a8_linear``. Activations are quantized per token (or with a static
  checkpoint ``input_scale``), int8 x int8 products are summed in int32 and rescaled.

Each path has a torch reference that the CPU runs and the kernels are tested against:
``w8a16_reference`` (float32 matmul of the int8 codes, then the channel scale) and
``w8a8_reference`` (the exact int32 accumulator, computed in float64 on CPU: every product
is at most 127 * 127 and the sums stay far below 2**53, so nothing rounds).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from engine_quant_int8.quantize import quantize_per_token

from engine.platforms import device_index

#: Most tokens for which ``int8_linear`` takes the weight-only (W8A16) path; more take W8A8.
#: Measured on an H100 (``python plugins-quant/int8/benchmarks/bench_kernels.py``, 2026-11-23), summed over
#: the four Llama-3-8B linears: M=32 weight-only 138 us vs W8A8 145 us; M=64 222 vs 147 us. A
#: graph-captured batch size (32), so padding never moves a batch across the switch.
WEIGHT_ONLY_MAX_M = 32
#: Most tokens for which the weight-only path runs the GEMV kernel rather than tl.dot tiles.
GEMV_MAX_M = 1
#: The large-M GEMM on CUDA: ``"triton"`` (int8 tl.dot, rescale and bias in its epilogue) or
#: ``"int_mm"`` (torch._int_mm, then a Triton rescale). Both quantize in one Triton launch first.
#: Same measurement, four linears summed: M=128 triton 152 us vs int_mm 167; M=256 188 vs 250.
LARGE_M_GEMM = "triton"
#: SMs assumed where no CUDA device is asked (the Triton interpreter in tests): an H100's.
_DEFAULT_SMS = 132

# torch._int_mm on CUDA: more than 16 rows; inner and output dims multiples of 8.
_INT_MM_MIN_ROWS = 17
_INT_MM_ALIGN = 8


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The device's SM count (cached host query; no sync), which sizes split-K and tiles."""
    if device.type != "cuda":
        return _DEFAULT_SMS
    return _cuda_sms(device_index(device))


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None]).T + bias`` in ``x.dtype``, by the path for ``x``'s token count.

    Args:
        x: activations ``[..., in]`` (float32, bfloat16 or float16).
        weight: ``[out, in]`` int8, row-major.
        weight_scale: ``[out]`` float32 per-output-channel scales.
        bias: optional ``[out]``, added in ``x.dtype``.
        input_scale: a checkpoint's static activation scale (one float32 element); None quantizes
            per token. Used by the W8A8 path only: the weight-only path does not quantize activations.
    """
    if math.prod(x.shape[:-1]) <= WEIGHT_ONLY_MAX_M:
        return w8a16_linear(x, weight, weight_scale, bias)
    return w8a8_linear(x, weight, weight_scale, bias, input_scale)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The weight-only path: Triton kernels on CUDA, ``w8a16_reference`` elsewhere."""
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.device.type == "cuda":
        from engine_quant_int8.kernels_w8a16 import w8a16_linear_triton

        out = w8a16_linear_triton(x2d, weight, weight_scale, bias, x2d.shape[0] <= GEMV_MAX_M, num_sms(x2d.device))
    else:
        out = w8a16_reference(x2d, weight, weight_scale, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 path: Triton (or ``torch._int_mm``, see ``LARGE_M_GEMM``) on CUDA, ``w8a8_reference`` elsewhere."""
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.device.type == "cuda":
        from engine_quant_int8 import kernels_w8a8

        if LARGE_M_GEMM == "int_mm" and x2d.shape[0] >= _INT_MM_MIN_ROWS and uses_int_mm(x2d, weight):
            out = kernels_w8a8.w8a8_linear_int_mm(x2d, weight, weight_scale, bias, input_scale)
        else:
            out = kernels_w8a8.w8a8_linear_triton(x2d, weight, weight_scale, bias, input_scale, num_sms(x2d.device))
    else:
        out = w8a8_reference(x2d, weight, weight_scale, bias, input_scale)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def w8a16_reference(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``((x @ codes.T) * weight_scale) -> x.dtype``, then ``+ bias``: float32 sums of exact products."""
    acc = x2d.float() @ weight.float().t()
    out = (acc * weight_scale[None, :]).to(x2d.dtype)
    return out + bias if bias is not None else out


def w8a8_reference(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``((acc_int32 * x_scale) * weight_scale) -> x.dtype``, then ``+ bias``."""
    qx, x_scale = quantize_per_token(x2d, input_scale)
    acc = int8_matmul(qx, weight)
    out = (acc.float() * x_scale * weight_scale[None, :]).to(x2d.dtype)
    return out + bias if bias is not None else out


def uses_int_mm(qx: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``int8_matmul`` runs ``torch._int_mm`` for these operands."""
    out_features, in_features = weight.shape
    return (qx.device.type == "cuda" and hasattr(torch, "_int_mm")
            and in_features % _INT_MM_ALIGN == 0 and out_features % _INT_MM_ALIGN == 0)


def int8_matmul(qx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``qx [M, K] int8 @ weight [N, K] int8 .T`` as an exact ``[M, N]`` int32 accumulator."""
    if uses_int_mm(qx, weight):
        rows = qx.shape[0]
        if rows < _INT_MM_MIN_ROWS:
            qx = F.pad(qx, (0, 0, 0, _INT_MM_MIN_ROWS - rows))
        return torch._int_mm(qx, weight.t())[:rows]
    return (qx.double() @ weight.double().t()).to(torch.int32)
