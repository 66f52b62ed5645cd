"""compressed-tensors' ``pack-quantized`` layout for int weights, per projection with ``N``
outputs, ``K`` inputs, ``P = 32 // num_bits`` codes per word and groups of ``G`` inputs:

- ``weight_packed`` int32 ``[N, K / P]``: signed codes offset by ``2**(bits-1)`` (so unsigned),
  packed along the INPUT dim, input ``k`` at bits ``(k % P) * bits`` of word ``k // P``;
- ``weight_scale`` ``[N, K / G]`` (``[N, 1]`` for ``strategy: channel``), in the model's dtype;
- ``weight_zero_point`` (asymmetric only) int32 ``[N / P, K / G]``: the zero points, offset and
  packed the same way but along the OUTPUT dim;
- ``weight_shape`` int64 ``[2]``: ``[N, K]``;
- ``weight_g_idx`` int32 ``[K]`` for the old ``actorder: group`` checkpoints.

``W[n, k] = (code - zero) * scale`` (the offsets cancel; symmetric zero is ``2**(bits-1)``
after the offset). ``pack_compressed`` writes this layout for the tests, ``unpack_compressed``
reads it.
"""

from __future__ import annotations

import torch
from engine_quant_wna16.layout import IntWeight, pack_int32, unpack_int32


def pack_compressed(w: IntWeight, scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    k, n = w.codes.shape
    tensors = {"weight_packed": pack_int32(w.codes.t(), w.bits, 1),
               "weight_scale": w.scales.t().to(scale_dtype).contiguous(),
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if w.zeros is not None:
        tensors["weight_zero_point"] = pack_int32(w.zeros.t(), w.bits, 0)
    if w.g_idx is not None:
        tensors["weight_g_idx"] = w.g_idx.to(torch.int32)
    return tensors


def unpack_compressed(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                      weight_zero_point: torch.Tensor | None, g_idx: torch.Tensor | None,
                      bits: int, group_size: int) -> IntWeight:
    zeros = None if weight_zero_point is None else unpack_int32(weight_zero_point, bits, 0).t()
    return IntWeight(codes=unpack_int32(weight_packed, bits, 1).t(), scales=weight_scale.t(), zeros=zeros,
                     g_idx=g_idx, bits=bits, group_size=group_size)
