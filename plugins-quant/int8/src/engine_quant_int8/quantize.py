"""Symmetric int8 quantize / dequantize maths for weights (per channel) and activations (per token).

``x ~= q * scale`` with ``q`` in ``[-127, 127]``: -128 is never produced, so the grid is
symmetric and negating a tensor negates its codes.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
# An all-zero row would give scale 0 and 0/0 = NaN; any positive floor keeps q = 0.
MIN_SCALE = 1e-12


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Float32 maths on every device, so CPU and CUDA produce bit-identical codes and scales. The
    # divisor is a tensor on x's device, not a Python number: on CUDA PyTorch divides by a CPU
    # scalar as a multiplication by its reciprocal, which is not IEEE division (a scale can then
    # differ in its last bit from the CPU's and from the Triton kernel's ``div_rn``).
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.full_like(amax, INT8_MAX)).clamp(min=MIN_SCALE)
    q = torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``weight [out, in]`` with one scale per output row.

    Returns:
        ``(q [out, in] int8, scale [out] float32)``.
    """
    q, scale = _quantize_rows(weight)
    return q, scale.squeeze(-1)


def quantize_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes activations ``x [tokens, in]`` with a dynamic scale per token, or with the
    checkpoint's static per-tensor ``input_scale`` (one float32 element) for every token.

    Returns:
        ``(q [tokens, in] int8, scale [tokens, 1] float32)``.
    """
    if input_scale is None:
        return _quantize_rows(x)
    scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    q = torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [out, in] * scale [out]`` in float32, then cast to ``dtype``."""
    return (q.float() * scale.float()[:, None]).to(dtype)
