"""The alignment's result (``ExpertBlocks``) and the batch sizes each way of computing it takes.

Shared by the torch alignment (``engine.layers.moe.align``), which picks a way, and the Triton
kernels (``align_kernel``, ``route_align_kernel``), which produce the same result: kept below both
so a kernel module never imports the module that dispatches to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertBlocks:
    """The slots of a batch grouped by expert, ``block_m`` at a time."""

    #: ``[max_padded]`` int32: slot ids, sorted by expert; padding holds ``num_slots``.
    sorted_slot_ids: torch.Tensor
    #: ``[max_padded // block_m]`` int32: the expert of each block; ``-1``: not on this rank
    #: (or past ``num_padded``).
    block_expert_ids: torch.Tensor
    #: ``[1]`` int32 on the device: how many entries of ``sorted_slot_ids`` are in use (blocks
    #: from there on are skipped by the kernel).
    num_padded: torch.Tensor
    #: ``tokens * top_k``: the slot count, and the padding value.
    num_slots: int
    block_m: int


#: The most slots (``tokens * top_k``) the one-program Triton kernel takes (512 tokens at top 8):
#: it holds every slot and every entry in one tile and sorts the slots (``slots * log^2 slots``
#: steps); above this the three chunked launches (``align_kernel.align_slots_chunked``) take over.
#: Not measured against them at this size.
ALIGN_KERNEL_MAX_SLOTS = 4096


def chunks_can_align(num_slots: int, block_m: int) -> bool:
    """Whether the chunked Triton launches take this batch: any slots and a power-of-two
    ``block_m`` (a Triton block dimension)."""
    return num_slots > 0 and block_m > 0 and block_m & (block_m - 1) == 0


def kernel_can_align(num_slots: int, block_m: int) -> bool:
    """Whether the one-program Triton kernel takes this batch: what the chunked launches take, up
    to ``ALIGN_KERNEL_MAX_SLOTS`` slots."""
    return chunks_can_align(num_slots, block_m) and num_slots <= ALIGN_KERNEL_MAX_SLOTS


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """The most entries ``align_slots_by_expert`` can need: every group that gets a slot padding a
    partial block. At most ``min(num_experts + 1, num_slots)`` groups (the experts and "elsewhere")
    get one, so at decode the bound follows the slots, not the experts: 8 slots need at most 8
    blocks, where ``num_experts + 1`` partial blocks would be 129 for 128 experts (the grouped GEMMs
    launch a program per block and column tile of this size, the unused ones returning at once)."""
    worst = num_slots + min(num_experts + 1, num_slots) * (block_m - 1)
    return -(-worst // block_m) * block_m
