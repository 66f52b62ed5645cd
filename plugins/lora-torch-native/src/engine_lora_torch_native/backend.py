"""``TorchNativeLoraBackend``: the LoRA shrink/expand of ``engine.lora.backend`` in plain torch.

On the CPU each segment is one matmul over its tokens' rows (segment bounds are read on the host,
which costs nothing there). On an accelerator reading them would synchronise the device and break
CUDA-graph capture, so each token's slot is found on the device (``searchsorted`` over the segment
offsets) and every slot of the pool runs one matmul over all tokens, masked to its own: more
arithmetic (``num_slots`` times the adapters' share, small beside the base layer's) for no host
round trip and shapes fixed by the batch size alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.errors import ConfigError
from engine.lora.backend import LoraBatchInfo


class TorchNativeLoraBackend:
    """``per_segment``: True runs one matmul per segment (reads segment bounds on the host),
    False one masked matmul per slot; None (the default) chooses by the tensors' device. On the
    host path, batches of several segments and at most ``gather_max_tokens`` tokens (decode
    steps) gather each token's matrices and run one batched product instead: a decode step of
    many adapters is then two products per layer, not two per row.

    ``fold_max_rows`` (option ``lora_torch_native.fold_max_rows``, default 0: never): batches of up
    to that many tokens take the folded shrink (``fold_expand``), the reference form of what the
    ``triton`` backend runs there."""

    name = "torch_native"

    def __init__(self, per_segment: bool | None = None, gather_max_tokens: int = 32,
                 options: dict[str, Any] | None = None) -> None:
        self.per_segment = per_segment
        self.gather_max_tokens = gather_max_tokens
        fold_rows = (options or {}).get("fold_max_rows", 0)
        if isinstance(fold_rows, bool) or not isinstance(fold_rows, int) or fold_rows < 0:
            raise ConfigError(f"lora_torch_native.fold_max_rows: invalid value {fold_rows!r}; accepted: an integer >= 0 "
                             "(0: never fold the shrink into the base GEMM)")
        self.fold_max_rows = fold_rows
        # Every LoRA layer of one forward gets the same info: its segments are read once.
        self._segments_of: tuple[LoraBatchInfo | None, list[tuple[int, int, int, float]]] = (None, [])
        self._gather_of: tuple[torch.Tensor, torch.Tensor] | None = None

    def _host_segments(self, info: LoraBatchInfo) -> list[tuple[int, int, int, float]]:
        if self._segments_of[0] is not info:
            self._segments_of = (info, _host_segments(info))
            self._gather_of = None
        return self._segments_of[1]

    def _token_gather(self, info: LoraBatchInfo, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's slot (0 for tokens outside the segments that add anything) and whether
        it adds anything, from the host segments; made once per forward."""
        segments = self._host_segments(info)
        if self._gather_of is None or self._gather_of[0].shape[0] != num_tokens:
            slots = torch.zeros(num_tokens, dtype=torch.int64)
            keep = torch.zeros(num_tokens, dtype=torch.bool)
            for lo, hi, slot, _ in segments:
                slots[lo:hi] = slot
                keep[lo:hi] = True
            device = info.seg_indptr.device
            self._gather_of = (slots.to(device), keep.to(device))
        return self._gather_of

    def _per_segment(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" if self.per_segment is None else self.per_segment

    # -- shrink: y = x @ A^T per segment -------------------------------------------------
    def shrink(self, x: torch.Tensor, weights: torch.Tensor, info: LoraBatchInfo) -> torch.Tensor:
        if self._per_segment(x):
            segments = self._host_segments(info)
            if len(segments) == 1 and segments[0][:2] == (0, x.shape[0]):
                return x @ weights[segments[0][2]].T  # one adapter for the whole batch
            if len(segments) > 1 and x.shape[0] <= self.gather_max_tokens:
                # One product against every slot's A (a few times the adapters' share, tiny next
                # to the layer), then each token's own slot's columns: far faster on the CPU than
                # a batched product of one-row matrices.
                slots, keep = self._token_gather(info, x.shape[0])
                num_slots, cols = weights.shape[0], weights.shape[1]
                every = (x @ weights.reshape(num_slots * cols, -1).T).view(x.shape[0], num_slots, cols)
                y = every[torch.arange(x.shape[0], device=x.device), slots]
                return y * keep.to(y.dtype).unsqueeze(1)
            out = torch.zeros(x.shape[0], weights.shape[1], dtype=x.dtype, device=x.device)
            for lo, hi, slot, _ in segments:
                torch.matmul(x[lo:hi], weights[slot].T, out=out[lo:hi])
            return out
        out = torch.zeros(x.shape[0], weights.shape[1], dtype=x.dtype, device=x.device)
        token_slot = _token_slots(info, x.shape[0])
        for slot in range(weights.shape[0]):
            mask = ((token_slot == slot) & (info.lora_ranks[slot] > 0)).to(x.dtype).unsqueeze(1)
            out.add_((x @ weights[slot].T) * mask)
        return out

    # -- expand: out[:, slice] += scaling * y_slice @ B_slice^T -----------------------------
    def expand(self, y: torch.Tensor, weights: torch.Tensor, info: LoraBatchInfo, out: torch.Tensor,
               slice_offsets: Sequence[int]) -> None:
        n_slices = len(slice_offsets) - 1
        rank = y.shape[1] // n_slices
        if self._per_segment(out):
            segments = self._host_segments(info)
            if len(segments) > 1 and out.shape[0] <= self.gather_max_tokens:
                slots, keep = self._token_gather(info, out.shape[0])
                scale = (info.scalings[slots] * keep).to(out.dtype).unsqueeze(1)
                gathered = weights[slots]  # [T, N_total, R]: each token's own B
                for i in range(n_slices):
                    a, b = slice_offsets[i], slice_offsets[i + 1]
                    # A broadcast multiply and a sum over R: batched one-row products, which
                    # torch.bmm runs several times slower on the CPU.
                    delta = (gathered[:, a:b] * y[:, None, i * rank:(i + 1) * rank]).sum(-1)
                    out[:, a:b].add_(delta * scale)
                return
            for lo, hi, slot, scale in segments:
                for i in range(n_slices):
                    a, b = slice_offsets[i], slice_offsets[i + 1]
                    out[lo:hi, a:b].addmm_(y[lo:hi, i * rank:(i + 1) * rank], weights[slot, a:b].T, alpha=scale)
            return
        token_slot = _token_slots(info, y.shape[0])
        # Per-token scale, zero for rank-0 slots: one product per slot, masked to its tokens.
        scale = torch.where(info.lora_ranks > 0, info.scalings, torch.zeros_like(info.scalings))
        for slot in range(weights.shape[0]):
            weight = ((token_slot == slot).to(torch.float32) * scale[slot]).to(out.dtype).unsqueeze(1)
            for i in range(n_slices):
                a, b = slice_offsets[i], slice_offsets[i + 1]
                out[:, a:b].add_((y[:, i * rank:(i + 1) * rank] @ weights[slot, a:b].T) * weight)


    # -- folded shrink: h = x @ [W; A_0; ...]^T from the layer's GEMM --------------------------
    def fold_expand(self, h: torch.Tensor, weights: torch.Tensor, info: LoraBatchInfo,
                    slice_offsets: Sequence[int]) -> torch.Tensor:
        """The base columns of ``h`` plus each token's adapter: its own slot's columns of ``h``
        are its shrink (gathered on the device), expanded by ``expand``."""
        n, cols = int(slice_offsets[-1]), (len(slice_offsets) - 1) * weights.shape[2]
        h_slots = (h.shape[1] - n) // cols  # the slots past these have rank 0: expand skips their tokens
        slots = _token_slots(info, h.shape[0])
        every = h[:, n:].reshape(h.shape[0], h_slots, cols)
        y = every[torch.arange(h.shape[0], device=h.device), slots.clamp(min=0, max=max(h_slots - 1, 0))]
        out = h[:, :n].contiguous()
        self.expand(y, weights, info, out, slice_offsets)
        return out


def _host_segments(info: LoraBatchInfo) -> list[tuple[int, int, int, float]]:
    """(first token, end, slot, scaling) of each non-empty segment on a slot with rank > 0."""
    bounds = info.seg_indptr.tolist()
    ranks = info.lora_ranks.tolist()
    scalings = info.scalings.tolist()
    return [(bounds[s], bounds[s + 1], slot, scalings[slot])
            for s, slot in enumerate(info.weight_indices.tolist()[:info.num_segments])
            if bounds[s + 1] > bounds[s] and ranks[slot] > 0]


def _token_slots(info: LoraBatchInfo, num_tokens: int) -> torch.Tensor:
    """Each token's slot, on the device: the segment whose end offset first exceeds its index.
    Tokens beyond the last segment (CUDA-graph padding) get slot -1, which matches none."""
    positions = torch.arange(num_tokens, device=info.seg_indptr.device, dtype=torch.int32)
    seg = torch.searchsorted(info.seg_indptr[1:info.num_segments + 1], positions, right=True)
    inside = seg < info.num_segments
    slots = info.weight_indices[seg.clamp(max=max(info.num_segments - 1, 0))].to(torch.int64)
    return torch.where(inside, slots, torch.full_like(slots, -1))
