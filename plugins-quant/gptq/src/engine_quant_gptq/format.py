"""The GPTQ checkpoint layout (AutoGPTQ, GPTQModel), per projection with ``K`` inputs, ``N``
outputs, ``P = 32 // bits`` codes per word and ``G`` inputs per group:

- ``qweight`` int32 ``[K / P, N]``: codes packed along the INPUT dim, input ``k`` at bits
  ``(k % P) * bits`` of row ``k // P``;
- ``qzeros`` int32 ``[K / G, N / P]``: zero points packed along the output dim in plain order.
  The original format (``checkpoint_format: gptq``, "v1") stores ``zero - 1`` (an artefact of
  AutoGPTQ's kernels; a zero of 0 wraps to the top code and reads back as ``2**bits``, the
  format's known defect); ``gptq_v2`` stores the zero itself;
- ``scales`` float16 ``[K / G, N]``;
- ``g_idx`` int32 ``[K]``: the group of each input (act-order, ``desc_act: true``, scatters
  groups over K; otherwise ``k // G``).

``W[n, k] = (code - zero) * scale`` of group ``g_idx[k]``. Symmetric checkpoints
(``sym: true``) store zero ``2**(bits-1)`` everywhere; ``pack_gptq`` writes this layout,
``unpack_gptq`` reads it.
"""

from __future__ import annotations

import torch
from engine_quant_wna16.layout import IntWeight, pack_int32, unpack_int32


def pack_gptq(w: IntWeight, v2: bool = False) -> dict[str, torch.Tensor]:
    """``{"qweight", "qzeros", "scales", "g_idx"}`` of ``w`` (v1 offsets unless ``v2``)."""
    k, n = w.codes.shape
    zeros = w.zeros if w.zeros is not None else torch.full_like(w.scales, 1 << (w.bits - 1), dtype=torch.int32)
    if not v2:
        if bool((zeros == 0).any()):
            raise ValueError("GPTQ v1 cannot store a zero point of 0 (it stores zero - 1)")
        zeros = zeros - 1
    g_idx = w.g_idx if w.g_idx is not None else torch.arange(k) // w.group_size
    return {"qweight": pack_int32(w.codes, w.bits, 0),
            "qzeros": pack_int32(zeros, w.bits, 1),
            "scales": w.scales.to(torch.float16).contiguous(),
            "g_idx": g_idx.to(torch.int32).contiguous()}


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int, group_size: int, sym: bool, v2: bool) -> IntWeight:
    """The logical weight; ``g_idx`` None when the checkpoint is not act-order (``k // G`` then).
    Symmetric weights ignore ``qzeros`` (the kernels use the constant ``2**(bits-1)``)."""
    zeros = None
    if not sym:
        zeros = unpack_int32(qzeros, bits, 1) + (0 if v2 else 1)
    return IntWeight(codes=unpack_int32(qweight, bits, 0), scales=scales, zeros=zeros, g_idx=g_idx,
                     bits=bits, group_size=group_size)
