"""Batch descriptions FlashInfer's ``plan()`` takes, built from the engine's pools.

Nothing here imports flashinfer, so it runs (and is tested) on any device.

FlashInfer reads a paged KV cache through three arrays per batch (CSR style):
``kv_indptr[i]..kv_indptr[i+1]`` are row i's entries in ``kv_indices`` (page ids, in
order) and ``kv_last_page_len[i]`` says how many slots of its last page are used. The
engine keeps one KV slot per position in ``req_to_token``; with page size P the
allocator keeps position p of a row at offset ``p % P`` of a page, so page j of a
row is ``req_to_token[row, j * P] // P``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch


class _LayerLike(Protocol):
    scaling: float
    logit_cap: float
    sliding_window_size: int


@dataclass(frozen=True)
class LayerKey:
    """The per-layer settings FlashInfer fixes at ``plan()`` time.

    Layers sharing a key share one planned wrapper per batch; a model whose layers
    differ (e.g. alternating sliding-window and full layers) gets one wrapper per key.
    """

    # FlashInfer keeps keys with q_pos - k_pos <= window_left; -1 disables the window.
    window_left: int
    # tanh soft cap on the logits; 0 disables it.
    logits_soft_cap: float
    sm_scale: float

    @classmethod
    def of(cls, layer: _LayerLike) -> LayerKey:
        """The engine's window W keeps keys with ``q_pos - k_pos < W`` (Hugging Face's
        convention); FlashInfer's ``window_left`` is inclusive, hence ``W - 1``."""
        w = layer.sliding_window_size
        cap = float(layer.logit_cap) if layer.logit_cap and layer.logit_cap > 0 else 0.0
        return cls(window_left=w - 1 if w and w > 0 else -1, logits_soft_cap=cap,
                   sm_scale=float(layer.scaling))


@dataclass
class PagedKVLayout:
    """FlashInfer's paged-KV description of one batch's rows."""

    # [bs + 1] int32 on the host: plan() needs the values on the CPU, so passing host
    # tensors spares it a device->host synchronisation.
    kv_indptr_cpu: torch.Tensor
    # [kv_indptr[-1]] int32 on the device: page ids of every row, concatenated.
    kv_indices: torch.Tensor
    # [bs] int32 on the host: used slots of each row's last page (1..P).
    kv_last_page_len_cpu: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.kv_last_page_len_cpu.shape[0])


def pages_per_row(seq_lens_cpu: list[int], page_size: int) -> list[int]:
    return [(s + page_size - 1) // page_size for s in seq_lens_cpu]


def build_paged_kv_layout(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: list[int],
    page_size: int,
) -> PagedKVLayout:
    """Gathers each row's page ids from ``req_to_token`` without a host loop or sync.

    Args:
        req_to_token: ``[slots, max_context]`` int32 KV slot of each (row slot, position).
        req_pool_indices: ``[bs]`` row slots of the batch (device).
        seq_lens: ``[bs]`` lengths on the device; ``seq_lens_cpu`` the same on the host
            (the host copy sizes the output, the device copy drives the gather).
        page_size: slots per page (1 makes every slot its own page).
    """
    device = req_to_token.device
    counts_cpu = pages_per_row(seq_lens_cpu, page_size)
    indptr = [0, *accumulate(counts_cpu)]
    total = indptr[-1]
    last = [s - (n - 1) * page_size if n else 0 for s, n in zip(seq_lens_cpu, counts_cpu, strict=True)]

    counts = torch.div(seq_lens.to(torch.int64) + (page_size - 1), page_size, rounding_mode="floor")
    starts = torch.cumsum(counts, 0) - counts  # each row's first entry in the flat output
    bs = int(req_pool_indices.shape[0])
    # output_size keeps repeat_interleave from reading the total back from the device.
    row = torch.repeat_interleave(torch.arange(bs, device=device), counts, output_size=total)
    page_in_row = torch.arange(total, device=device) - starts[row]
    slots = req_to_token[req_pool_indices.to(torch.int64)[row], page_in_row * page_size]
    indices = torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)
    return PagedKVLayout(
        kv_indptr_cpu=torch.tensor(indptr, dtype=torch.int32),
        kv_indices=indices,
        kv_last_page_len_cpu=torch.tensor(last, dtype=torch.int32),
    )


def qo_indptr(extend_seq_lens_cpu: list[int]) -> torch.Tensor:
    """``[bs + 1]`` int32 host offsets of each row's new tokens in ``q``."""
    return torch.tensor([0, *accumulate(extend_seq_lens_cpu)], dtype=torch.int32)


def tree_custom_mask(tree_mask: torch.Tensor, extend_seq_lens_cpu: list[int],
                     extend_prefix_lens_cpu: list[int]) -> torch.Tensor:
    """FlashInfer's ``custom_mask`` for a tree batch (``ForwardBatch.tree_mask``).

    FlashInfer takes, per row, a ``[qo_len, kv_len]`` bool matrix over the row's new tokens
    and its whole sequence (row-major, rows back to back); the engine's tree mask covers only
    the new tokens (``[n, n]`` per row). Each row's matrix is the prefix (all visible) followed
    by its ancestor matrix.
    """
    parts, offset = [], 0
    for n, prefix in zip(extend_seq_lens_cpu, extend_prefix_lens_cpu):
        tree = tree_mask[offset: offset + n * n].view(n, n)
        offset += n * n
        visible = torch.ones((n, prefix), dtype=torch.bool, device=tree_mask.device)
        parts.append(torch.cat([visible, tree], dim=1).flatten())
    return torch.cat(parts) if parts else tree_mask.new_zeros(0)


def padding_layout(seq_len: int, page_size: int, device: torch.device) -> PagedKVLayout:
    """One row of ``seq_len`` positions that all live in the reserved padding page 0.

    Lets ``warmup()`` run real kernels without request slots or KV writes.
    """
    n = (seq_len + page_size - 1) // page_size
    return PagedKVLayout(
        kv_indptr_cpu=torch.tensor([0, n], dtype=torch.int32),
        kv_indices=torch.zeros(n, dtype=torch.int32, device=device),
        kv_last_page_len_cpu=torch.tensor([seq_len - (n - 1) * page_size], dtype=torch.int32),
    )


# Head sizes FlashInfer's prefill and decode kernels are built for.
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def check_dtype(dtype: torch.dtype) -> None:
    """Refuses activation dtypes FlashInfer compiles no kernels for (float32 fails with a KeyError
    deep inside its JIT otherwise)."""
    if dtype not in (torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"attention backend 'flashinfer': dtype {name} is not supported; accepted: float16, bfloat16 "
            "(use --dtype bfloat16, or --attention triton for float32)"
        )


def check_head_dim(head_dim: int) -> None:
    """Refuses head sizes FlashInfer has no kernels for (it would fail deep inside a kernel)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"attention backend 'flashinfer': head_dim {head_dim} is not supported; accepted: "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))} (use --attention triton for other sizes)"
        )
