"""The ``triton`` LoRA backend: ``engine.lora.backend.LoraBackend`` over the SGMV kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine_lora_triton.kernels import has_pdl, sgmv_expand, sgmv_shrink


class TritonLoraBackend:
    """Segmented shrink (``x @ A.T``) and in-place expand (``out += s * y @ B.T``) per adapter slot.

    ``pdl``: launch both kernels with programmatic dependent launch where the device has it
    (sm_90+): a kernel starts while the one before it drains, reading the batch info and its first
    weight tile before it waits."""

    name = "triton"

    def __init__(self, pdl: bool = True) -> None:
        self.pdl = pdl

    def shrink(self, x: torch.Tensor, weights: torch.Tensor, info: Any) -> torch.Tensor:
        return sgmv_shrink(x, weights, info.seg_indptr, info.weight_indices, info.lora_ranks,
                           info.num_segments, info.max_seg_len, pdl=self.pdl and has_pdl(x.device))

    def expand(self, y: torch.Tensor, weights: torch.Tensor, info: Any, out: torch.Tensor,
               slice_offsets: Sequence[int]) -> None:
        sgmv_expand(y, weights, out, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                    info.num_segments, info.max_seg_len, slice_offsets, pdl=self.pdl and has_pdl(out.device))


def create(options: dict[str, Any] | None = None) -> TritonLoraBackend:
    """The backend (``LoraBackendSpec.factory``) with the plugin's options (``lora-triton.pdl``);
    block sizes are chosen per call from the shapes."""
    return TritonLoraBackend(pdl=bool((options or {}).get("pdl", True)))
