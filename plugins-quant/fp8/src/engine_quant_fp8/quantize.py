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

    On CUDA this is one Triton launch (``engine_quant_fp8.kernels.quantize_per_token_triton``);
    elsewhere the torch ops below, which are also its reference.

    Returns:
        ``(q [tokens, in] float8_e4m3fn, scale [tokens, 1] float32)``; a static scale is
        broadcast to every token so the GEMM sees one layout.
    """
    if x.is_cuda and x.dim() == 2 and x.shape[-1] > 0:
        from engine_quant_fp8.kernels import quantize_per_token_triton

        return quantize_per_token_triton(x, static_scale)
    return quantize_per_token_reference(x, static_scale)


def quantize_per_token_reference(x: torch.Tensor,
                                 static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch-op version of ``quantize_per_token`` (CPU path and test oracle)."""
    if static_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return _to_fp8(x, scale), scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [out, in] * scale [out]`` in float32, then cast to ``dtype`` (one rounding)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_per_block(weight: torch.Tensor, block_size: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``weight [out, in]`` with one scale per ``block_size`` tile (DeepSeek-V3 layout).

    Edge tiles (``out`` or ``in`` not a multiple of the block) take the max of the part that exists.

    Returns:
        ``(q [out, in] float8_e4m3fn, scale [ceil(out/bn), ceil(in/bk)] float32)``, ``scale``
        being the multiplier that dequantizes (the checkpoint's ``weight_scale_inv``).
    """
    bn, bk = block_size
    rows, cols = weight.shape
    nb, kb = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    amax = padded.abs().reshape(nb, bn, kb, bk).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    return _to_fp8(weight, expand_block_scale(scale, block_size, rows, cols)), scale


def expand_block_scale(scale: torch.Tensor, block_size: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """``scale [ceil(rows/bn), ceil(cols/bk)]`` repeated to one float32 value per element ``[rows, cols]``."""
    bn, bk = block_size
    return scale.float().repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def dequantize_per_block(q: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                         dtype: torch.dtype) -> torch.Tensor:
    """``q [out, in]`` times its tile's scale, in float32, then cast to ``dtype`` (one rounding)."""
    return (q.float() * expand_block_scale(scale, block_size, *q.shape)).to(dtype)
