"""AutoAWQ's GEMM checkpoint layout (``"version": "gemm"``), per projection with ``K`` inputs,
``N`` outputs and groups of ``G`` inputs:

- ``qweight`` int32 ``[K, N / 8]``: eight 4-bit codes of one input row per word, packed along
  the OUTPUT dim in AWQ's interleaved order: the code at bits ``4 * i`` belongs to output
  ``8 * word + AWQ_ORDER[i]`` (0, 2, 4, 6, 1, 3, 5, 7), the order AWQ's CUDA kernels unpack in;
- ``qzeros`` int32 ``[K / G, N / 8]``: the zero points, packed the same way (stored as is);
- ``scales`` float16 ``[K / G, N]``.

``W[n, k] = (code - zero) * scale`` of group ``k // G``. ``pack_awq`` writes this layout (the
tests' checkpoints), ``unpack_awq`` reads it.
"""

from __future__ import annotations

import torch
from engine_quant_wna16.layout import IntWeight, pack_int32, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
BITS = 4


def pack_awq(w: IntWeight) -> dict[str, torch.Tensor]:
    """``{"qweight", "qzeros", "scales"}`` of an asymmetric 4-bit ``IntWeight`` without act-order."""
    if w.bits != BITS or w.zeros is None or w.g_idx is not None:
        raise ValueError("AWQ stores asymmetric 4-bit weights without g_idx")
    return {"qweight": pack_int32(w.codes, BITS, 1, AWQ_ORDER),
            "qzeros": pack_int32(w.zeros, BITS, 1, AWQ_ORDER),
            "scales": w.scales.to(torch.float16).contiguous()}


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> IntWeight:
    """The logical weight of one projection (or fused projections) in AWQ's layout."""
    return IntWeight(codes=unpack_int32(qweight, BITS, 1, AWQ_ORDER), scales=scales,
                     zeros=unpack_int32(qzeros, BITS, 1, AWQ_ORDER), g_idx=None, bits=BITS, group_size=group_size)
