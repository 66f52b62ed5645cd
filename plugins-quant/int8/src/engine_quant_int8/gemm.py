"""W8A8 int8 linear: int8 x int8 products accumulated in int32, then rescaled in float32.

On CUDA ``torch._int_mm`` runs the int8 GEMM (cuBLASLt, int32 accumulation). On CPU
(and for shapes ``_int_mm`` rejects) the same int32 accumulator is computed exactly
in float64: every product is at most 127 * 127 and the sum stays far below 2**53, so
no rounding happens and both paths hand identical integers to the shared rescale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_quant_int8.quantize import quantize_per_token

# torch._int_mm on CUDA: more than 16 rows; inner and output dims multiples of 8.
_INT_MM_MIN_ROWS = 17
_INT_MM_ALIGN = 8


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
            # Decode batches are often tiny; zero rows pad up to the kernel's minimum.
            qx = F.pad(qx, (0, 0, 0, _INT_MM_MIN_ROWS - rows))
        # weight.t() is a column-major [K, N] view: no copy of the weight per call.
        return torch._int_mm(qx, weight.t())[:rows]
    return (qx.double() @ weight.double().t()).to(torch.int32)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``x`` quantized per token and ``W = weight * weight_scale[:, None]``.

    Args:
        x: activations ``[..., in]`` (float32, bfloat16 or float16).
        weight: ``[out, in]`` int8.
        weight_scale: ``[out]`` float32.
        bias: optional ``[out]``, added in ``x.dtype``.
    """
    x2d = x.reshape(-1, x.shape[-1])
    qx, x_scale = quantize_per_token(x2d)
    acc = int8_matmul(qx, weight)
    out = (acc.float() * x_scale * weight_scale[None, :]).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
