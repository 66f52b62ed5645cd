"""The interface of LoRA backend plugins (``--lora-backend``; hook ``register_lora_backends``).

A forward's tokens are split into segments, contiguous runs of tokens that use one adapter slot
of the device pool. A backend computes, for one LoRA-wrapped projection, the low-rank product
``x @ A^T`` (``shrink``) and adds ``scaling * y @ B^T`` to the layer's output (``expand``) for
every segment with the slot's weights. The reference below is the definition; the conformance
kit (``engine.testing.conformance.lora``) holds a backend to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class LoraBatchInfo:
    """Which adapter slot each token of one forward uses (all tensors on the tokens' device)."""

    num_segments: int
    #: int32 [num_segments + 1]: token offsets of the segments into x (a segment may be empty).
    seg_indptr: torch.Tensor
    #: int32 [num_segments]: the device-pool slot of each segment.
    weight_indices: torch.Tensor
    #: int32 [num_slots]: each slot's rank; 0 is an empty slot or the base model (adds nothing).
    lora_ranks: torch.Tensor
    #: float32 [num_slots]: each slot's scaling, lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
    scalings: torch.Tensor
    #: the longest segment in tokens, a host int (kernels size grids with it; may be an upper bound).
    max_seg_len: int
    #: True when segment t is exactly token t for every segment (decode batches as the engine
    #: builds them: one segment per row); kernels may then skip finding each token's segment.
    one_token_segments: bool = False


@runtime_checkable
class LoraBackend(Protocol):
    """Segmented (SGMV) shrink and expand. Both must be capturable in CUDA graphs on CUDA: no host
    synchronisation and no allocation whose size depends on tensor values.

    A backend may also offer ``apply(x, a_weights, b_weights, info, out, slice_offsets)``, the
    same as ``expand(shrink(x, a_weights, info), b_weights, info, out, slice_offsets)`` computed
    its own way (an intermediate other than ``shrink``'s ``y``); LoRA layers call it when present,
    and the conformance kit holds it to the reference too.

    A backend may also offer ``fold_expand(h, b_weights, info, slice_offsets) -> out`` with an int
    ``fold_max_rows`` (and optionally ``fold_min_rows``, default 1): for batches of
    ``fold_min_rows`` to ``fold_max_rows`` tokens on an unquantized layer without bias,
    the layer stacks its slots' A matrices under the weight (``W' = [W; A_0; ...; A_{S-1}]``) and
    one GEMM gives ``h = x @ W'^T``, ``[T, N + k * n_slices * R]`` (k <= S: the layers leave out the
    last slot, the base model's, of rank 0); ``fold_expand`` returns a new
    contiguous ``[T, N]`` (``N = slice_offsets[-1]``): ``h[:, :N]`` plus, for each token t on slot
    w with rank > 0, ``expand`` of ``y[t] = h[t, N + w*n_slices*R : N + (w+1)*n_slices*R]``
    (``reference_fold_expand``). Rows of tokens past the last segment are ``h``'s base columns."""

    name: str

    def shrink(self, x: torch.Tensor, weights: torch.Tensor, info: LoraBatchInfo) -> torch.Tensor:
        """x [T, K]; weights [num_slots, n_slices * R, K] (A matrices stacked per slice, rows
        beyond a slot's rank zero). Returns [T, n_slices * R] in x's dtype; rows of tokens whose
        slot has rank 0 are zero."""
        ...

    def expand(self, y: torch.Tensor, weights: torch.Tensor, info: LoraBatchInfo, out: torch.Tensor,
               slice_offsets: Sequence[int]) -> None:
        """y [T, n_slices * R] from ``shrink``; weights [num_slots, N_total, R] (B matrices);
        adds in place, for each slice i of ``slice_offsets`` (n_slices + 1 column offsets into
        out) and token t of a segment on slot w with rank > 0:
        ``out[t, off[i]:off[i+1]] += scalings[w] * y[t, i*R:(i+1)*R] @ weights[w, off[i]:off[i+1], :].T``."""
        ...


def lora_apply(backend: LoraBackend, x: torch.Tensor, a_weights: torch.Tensor, b_weights: torch.Tensor,
               info: LoraBatchInfo, out: torch.Tensor, slice_offsets: Sequence[int]) -> None:
    """What a LoRA layer runs: the backend's optional ``apply`` where it has one, else ``shrink``
    then ``expand``."""
    fused = getattr(backend, "apply", None)
    if fused is not None:
        fused(x, a_weights, b_weights, info, out, slice_offsets)
        return
    backend.expand(backend.shrink(x, a_weights, info), b_weights, info, out, slice_offsets)


def reference_shrink(x: torch.Tensor, weights: torch.Tensor, info: LoraBatchInfo) -> torch.Tensor:
    """``LoraBackend.shrink`` as a plain loop over segments, in float32 (the kit's oracle)."""
    out = torch.zeros(x.shape[0], weights.shape[1], dtype=torch.float32, device=x.device)
    bounds = info.seg_indptr.tolist()
    for seg, slot in enumerate(info.weight_indices.tolist()):
        lo, hi = bounds[seg], bounds[seg + 1]
        if hi > lo and int(info.lora_ranks[slot]) > 0:
            out[lo:hi] = x[lo:hi].float() @ weights[slot].float().T
    return out.to(x.dtype)


def reference_expand(y: torch.Tensor, weights: torch.Tensor, info: LoraBatchInfo, out: torch.Tensor,
                     slice_offsets: Sequence[int]) -> None:
    """``LoraBackend.expand`` as a plain loop over segments and slices, accumulating in float32."""
    rank = y.shape[1] // (len(slice_offsets) - 1)
    bounds = info.seg_indptr.tolist()
    for seg, slot in enumerate(info.weight_indices.tolist()):
        lo, hi = bounds[seg], bounds[seg + 1]
        if hi <= lo or int(info.lora_ranks[slot]) == 0:
            continue
        scale = float(info.scalings[slot])
        for i in range(len(slice_offsets) - 1):
            a, b = slice_offsets[i], slice_offsets[i + 1]
            delta = y[lo:hi, i * rank:(i + 1) * rank].float() @ weights[slot, a:b, :].float().T
            out[lo:hi, a:b] = (out[lo:hi, a:b].float() + scale * delta).to(out.dtype)


def reference_fold_expand(h: torch.Tensor, weights: torch.Tensor, info: LoraBatchInfo,
                          slice_offsets: Sequence[int]) -> torch.Tensor:
    """``LoraBackend.fold_expand`` as a plain loop: each token's own slot's columns of ``h`` are
    its shrink, expanded onto a copy of ``h``'s first ``slice_offsets[-1]`` columns (``h`` may
    leave out the last slots, which must then have rank 0)."""
    n_base = int(slice_offsets[-1])
    slot_cols = (len(slice_offsets) - 1) * weights.shape[2]
    y = torch.zeros(h.shape[0], slot_cols, dtype=h.dtype, device=h.device)
    bounds = info.seg_indptr.tolist()
    for seg, slot in enumerate(info.weight_indices.tolist()):
        lo, hi = bounds[seg], bounds[seg + 1]
        if n_base + (slot + 1) * slot_cols <= h.shape[1]:
            y[lo:hi] = h[lo:hi, n_base + slot * slot_cols:n_base + (slot + 1) * slot_cols]
    out = h[:, :n_base].clone()
    reference_expand(y, weights, info, out, slice_offsets)
    return out


__all__ = ["LoraBackend", "LoraBatchInfo", "reference_expand", "reference_fold_expand", "reference_shrink"]
