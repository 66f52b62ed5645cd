"""The ``triton`` LoRA backend: ``engine.lora.backend.LoraBackend`` over the SGMV kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.errors import ConfigError
from engine_lora_triton.fold import sgmv_expand_folded
from engine_lora_triton.launch import has_pdl, sgmv_expand, sgmv_shrink, sgmv_shrink_slots


class TritonLoraBackend:
    """Segmented shrink (``x @ A.T``) and in-place expand (``out += s * y @ B.T``) per adapter slot.

    ``pdl``: launch both kernels with programmatic dependent launch for decode batches (segments
    of at most one token) where the device has it (sm_90+): a kernel starts while the one before it
    drains, reading the batch info and its first weight tile before it waits. Multi-token batches
    launch without it: their grids fill the GPU, and early programs of the next kernel waiting on
    SMs slowed them (H200, bench_sgmv.py: prefill of 4 x 512 tokens 327 us with PDL, 273 us
    without; decode batch 1 11.1 us with, 19.0 us without)."""

    name = "triton"

    def __init__(self, pdl: bool = True, slot_shrink: bool = False, split_prefill: bool = True,
                 dense_expand: bool = False, fold_max_rows: int = 256, fold_min_rows: int = 16) -> None:
        self.pdl = pdl
        #: batches of fold_min_rows..fold_max_rows tokens take the folded shrink (``fold_expand``);
        #: fold_max_rows 0: never. On an H200 (bench_sgmv.py --fold) a decode batch of 1 lost with it:
        #: the extra GEMM rows and the expand's launch cost more than the small shrink and expand.
        self.fold_max_rows = fold_max_rows
        self.fold_min_rows = fold_min_rows
        self.dense_expand = dense_expand
        self.slot_shrink = slot_shrink
        self.split_prefill = split_prefill

    def shrink(self, x: torch.Tensor, weights: torch.Tensor, info: Any) -> torch.Tensor:
        return sgmv_shrink(x, weights, info.seg_indptr, info.weight_indices, info.lora_ranks,
                           info.num_segments, info.max_seg_len, pdl=self._pdl(info, x.device))

    def expand(self, y: torch.Tensor, weights: torch.Tensor, info: Any, out: torch.Tensor,
               slice_offsets: Sequence[int]) -> None:
        sgmv_expand(y, weights, out, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                    info.num_segments, info.max_seg_len, slice_offsets, pdl=self._pdl(info, out.device),
                    dense=self.dense_expand)

    def apply(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, info: Any, out: torch.Tensor,
              slice_offsets: Sequence[int]) -> None:
        """``expand(shrink(x))``; a batch of few token tiles (a short prefill) splits the shrink over
        K chunks (``split_chunk``) into float32 partial sums that the expand adds up, instead of
        looping over all of K in few programs. With ``slot_shrink`` a decode batch of 16+ one-token
        segments takes the per-slot shrink, whose partial sums the expand adds up likewise."""
        pdl = self._pdl(info, x.device)
        if self.slot_shrink and info.max_seg_len <= 1 and info.num_segments >= 16:
            y = sgmv_shrink_slots(x, a, info.seg_indptr, info.weight_indices, info.lora_ranks, info.num_segments,
                                  pdl=pdl)
        else:
            y = sgmv_shrink(x, a, info.seg_indptr, info.weight_indices, info.lora_ranks, info.num_segments,
                            info.max_seg_len, pdl=pdl, split=self.split_prefill)
        sgmv_expand(y, b, out, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                    info.num_segments, info.max_seg_len, slice_offsets, pdl=pdl, dense=self.dense_expand)

    def fold_expand(self, h: torch.Tensor, weights: torch.Tensor, info: Any,
                    slice_offsets: Sequence[int]) -> torch.Tensor:
        """The layer's output from ``h = x @ [W; A_0; ...]^T`` (``engine_lora_triton.fold``)."""
        return sgmv_expand_folded(h, weights, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                                  info.num_segments, slice_offsets, pdl=self._pdl(info, h.device),
                                  one_token=getattr(info, "one_token_segments", False))

    def _pdl(self, info: Any, device: torch.device) -> bool:
        return self.pdl and info.max_seg_len <= 1 and has_pdl(device)


def create(options: dict[str, Any] | None = None) -> TritonLoraBackend:
    """The backend (``LoraBackendSpec.factory``) with the plugin's options (``lora-triton.pdl``);
    block sizes are chosen per call from the shapes."""
    options = options or {}
    fold = {}
    for key, default in (("fold_max_rows", 256), ("fold_min_rows", 16)):
        value = options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"lora-triton.{key}: invalid value {value!r}; accepted: an integer >= 0 "
                              "(fold_max_rows 0: never fold the shrink into the base GEMM)")
        fold[key] = value
    if 0 < fold["fold_max_rows"] < fold["fold_min_rows"]:
        raise ConfigError(f"lora-triton.fold_min_rows: invalid value {fold['fold_min_rows']} with "
                          f"lora-triton.fold_max_rows {fold['fold_max_rows']}; accepted: fold_min_rows <= "
                          "fold_max_rows (or fold_max_rows 0: never fold the shrink into the base GEMM)")
    return TritonLoraBackend(pdl=bool(options.get("pdl", True)), slot_shrink=bool(options.get("slot_shrink", False)),
                             split_prefill=bool(options.get("split_prefill", True)),
                             dense_expand=bool(options.get("dense_expand", False)),
                             **fold)
