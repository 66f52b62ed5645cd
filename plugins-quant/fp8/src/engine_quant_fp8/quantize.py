"""FP8 (e4m3fn) quantize / dequantize maths, shared by weights and activations.

Scales are float32 and symmetric: ``x ~= q * scale`` with ``q`` in ``[-448, 448]``,
the largest finite e4m3fn value, so each row's (or tensor's) absolute maximum maps
exactly onto the top of the format.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# An all-zero row would give scale 0 and 0/0 = NaN; any positive floor keeps q = 0.
_MIN_SCALE = 1e-12


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # The clamp matters: float -> float8_e4m3fn casts saturate to NaN, not to 448.
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``weight [out, in]`` with one scale per output row.

    Returns:
        ``(q [out, in] float8_e4m3fn, scale [out] float32)``.
    """
    scale = (weight.abs().amax(dim=1).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return _to_fp8(weight, scale[:, None]), scale


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a whole tensor with one scale (the layout of FP8 checkpoints).

    Returns:
        ``(q float8_e4m3fn, scale [] float32)``.
    """
    scale = (weight.abs().amax().float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return _to_fp8(weight, scale), scale


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes activations ``x [tokens, in]``: a dynamic scale per token, or a static one.

    Returns:
        ``(q [tokens, in] float8_e4m3fn, scale [tokens, 1] float32)``; a static scale is
        broadcast to every token so the GEMM sees one layout.
    """
    if static_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return _to_fp8(x, scale), scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [out, in] * scale [out]`` in float32, then cast to ``dtype`` (one rounding)."""
    return (q.float() * scale.float()[:, None]).to(dtype)
