"""Round-to-nearest quantization of a float weight into ``IntWeight``: the test fixtures' and the
benchmark's quantizer (the plugins serve checkpoints quantized elsewhere; RTN needs no data).

The scales follow GPTQ's and compressed-tensors' min-max rules, so every format can store the
result exactly: asymmetric ``scale = (max - min) / (2**bits - 1)`` over each group with 0 kept
in range and ``zero = round(-min / scale)``; symmetric ``scale = absmax / (2**(bits-1) - 0.5)``
with ``zero = 2**(bits-1)``.
"""

from __future__ import annotations

import torch

from engine_quant_wna16.layout import IntWeight

_MIN_SCALE = 1e-8


def act_order_g_idx(in_features: int, group_size: int, seed: int = 0) -> torch.Tensor:
    """A GPTQ act-order ``g_idx``: input channels visited in a random order, ``group_size`` at a
    time (channel ``order[i]`` joins group ``i // group_size``)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(in_features, generator=gen)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group_size).to(torch.int32)
    return g_idx


def quantize_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                 g_idx: torch.Tensor | None = None, scale_dtype: torch.dtype = torch.float16) -> IntWeight:
    """Quantizes ``weight [N, K]`` per group of input channels.

    Args:
        bits: 4 or 8.
        group_size: input channels per group; -1 for one group per output channel.
        symmetric: zero point fixed at ``2**(bits-1)`` (no zeros stored).
        g_idx: ``[K]`` group of each input channel (act-order); default ``k // group_size``.
        scale_dtype: the scales are rounded to this dtype before the codes are computed, as a
            checkpoint stores them (so dequantizing the stored values reproduces the codes' grid).
    """
    n, k = weight.shape
    group = k if group_size == -1 else group_size
    w = weight.float()
    order = torch.sort(g_idx.long(), stable=True).indices if g_idx is not None else None
    if order is not None:
        w = w[:, order]
    grouped = w.reshape(n, k // group, group)
    maxq = (1 << bits) - 1
    if symmetric:
        absmax = grouped.abs().amax(-1)
        scales = (absmax / ((1 << (bits - 1)) - 0.5)).clamp(min=_MIN_SCALE).to(scale_dtype).float()
        zeros = torch.full_like(scales, float(1 << (bits - 1)))
    else:
        lo = grouped.amin(-1).clamp(max=0)
        hi = grouped.amax(-1).clamp(min=0)
        scales = ((hi - lo) / maxq).clamp(min=_MIN_SCALE).to(scale_dtype).float()
        zeros = torch.round(-lo / scales).clamp(0, maxq)
    codes = torch.round(grouped / scales[..., None] + zeros[..., None]).clamp(0, maxq).reshape(n, k)
    if order is not None:
        codes = torch.empty_like(codes).index_copy_(1, order, codes)
    return IntWeight(
        codes=codes.to(torch.int32).t().contiguous(),
        scales=scales.t().to(scale_dtype).contiguous(),
        zeros=None if symmetric else zeros.t().to(torch.int32).contiguous(),
        g_idx=None if g_idx is None else g_idx.to(torch.int32),
        bits=bits,
        group_size=group,
    )
