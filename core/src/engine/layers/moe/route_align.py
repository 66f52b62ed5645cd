"""Routing and slot alignment in one step: what ``FusedMoE`` runs at decode sizes on CUDA.

``select_experts`` and ``align_slots_by_expert`` are one launch each, and with expert parallelism
``FusedMoE.local_expert_ids`` adds a few elementwise launches between them. At decode the three
are tiny, so one Triton program does them all (``engine.layers.moe.route_align_kernel``): the
softmax top-k of every token, the mapping to this rank's expert ids, and the ``ExpertBlocks``
of the grouped GEMMs, from registers. Elsewhere (the CPU, batches past the caps below) the same
result comes from the separate steps, which are also the kernel's test oracle.
"""

from __future__ import annotations

import torch

from engine.layers.moe.align import align_slots_by_expert
from engine.layers.moe.expert_blocks import ExpertBlocks
from engine.layers.moe.route_align_sizes import (
    ROUTE_ALIGN_MAX_LOGITS,
    ROUTE_ALIGN_MAX_SLOTS,
    ROUTE_ALIGN_PAYS_MAX_SLOTS,
    route_align_applies,
    route_align_fits,
)
from engine.layers.moe.router import select_experts, triton_available

# The sizes are re-exported: callers know them from this module.
__all__ = [
    "ROUTE_ALIGN_MAX_LOGITS",
    "ROUTE_ALIGN_MAX_SLOTS",
    "ROUTE_ALIGN_PAYS_MAX_SLOTS",
    "route_align_applies",
    "route_align_fits",
    "route_and_align",
    "to_local_expert_ids",
]


def to_local_expert_ids(topk_ids: torch.Tensor, expert_start: int, num_local_experts: int) -> torch.Tensor:
    """Global expert ids -> ids among ``num_local_experts`` starting at ``expert_start`` (``-1``
    where another expert-parallel rank holds the expert)."""
    local = topk_ids - expert_start
    held = (local >= 0) & (local < num_local_experts)
    return torch.where(held, local, torch.full_like(local, -1))


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int,
                    expert_start: int = 0,
                    num_local_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks]:
    """``select_experts``, the mapping to local ids, and ``align_slots_by_expert``, together.

    Args:
        router_logits: ``[tokens, num_experts]`` over all experts (every rank's).
        top_k, renormalize: as for ``select_experts``.
        block_m: slots per block of the grouped GEMM that will take the blocks.
        expert_start, num_local_experts: the experts this rank holds (default: all).

    Returns:
        ``(topk_weights, topk_ids, blocks)``: float32 weights and int32 *local* ids
        (``[tokens, top_k]``, ``-1`` where another rank holds the expert), and the ids' alignment.
    """
    num_experts = router_logits.shape[1]
    num_local = num_experts if num_local_experts is None else num_local_experts
    if (triton_available(router_logits)
            and route_align_applies(router_logits.shape[0], num_experts, top_k, block_m)):
        from engine.layers.moe.route_align_kernel import route_and_align_triton

        return route_and_align_triton(router_logits, top_k, renormalize, block_m, expert_start, num_local)
    weights, ids = select_experts(router_logits, top_k, renormalize)
    if expert_start != 0 or num_local != num_experts:
        ids = to_local_expert_ids(ids, expert_start, num_local)
    return weights, ids, align_slots_by_expert(ids, num_local, block_m)
