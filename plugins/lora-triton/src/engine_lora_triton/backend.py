"""The ``triton`` LoRA backend: ``engine.lora.backend.LoraBackend`` over the SGMV kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine_lora_triton.kernels import sgmv_expand, sgmv_shrink


class TritonLoraBackend:
    """Segmented shrink (``x @ A.T``) and in-place expand (``out += s * y @ B.T``) per adapter slot."""

    name = "triton"

    def shrink(self, x: torch.Tensor, weights: torch.Tensor, info: Any) -> torch.Tensor:
        return sgmv_shrink(x, weights, info.seg_indptr, info.weight_indices, info.lora_ranks,
                           info.num_segments, info.max_seg_len)

    def expand(self, y: torch.Tensor, weights: torch.Tensor, info: Any, out: torch.Tensor,
               slice_offsets: Sequence[int]) -> None:
        sgmv_expand(y, weights, out, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                    info.num_segments, info.max_seg_len, slice_offsets)


def create(options: dict[str, Any] | None = None) -> TritonLoraBackend:
    """The backend (``LoraBackendSpec.factory``); it takes no options and keeps no state: block
    sizes are chosen per call from the shapes."""
    return TritonLoraBackend()
