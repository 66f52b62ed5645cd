"""Which batches the one-launch router and alignment (``route_align_kernel``) takes.

Shared by ``engine.layers.moe.route_align``, which dispatches, and the kernel module, which checks
its input: kept below both so the kernel module never imports the module that dispatches to it.
"""

from __future__ import annotations

from engine.layers.moe.expert_blocks import kernel_can_align

#: The most slots (``tokens * top_k``) the one-program kernel takes: 64 tokens at top 8, the
#: decode batches it is for. Its tile holds every slot and the logits of every token.
ROUTE_ALIGN_MAX_SLOTS = 512
#: The most logits (tokens and experts, each rounded up to a power of two) it holds: 64 tokens of
#: 128 experts, 32 registers a thread at 8 warps.
ROUTE_ALIGN_MAX_LOGITS = 8192


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


#: The most slots for which ``route_and_align`` takes the one-program kernel rather than the router
#: (one program per token) and the alignment (one program) as two launches. The one program does
#: every token's softmax top-k itself, so it slows with the batch: on an H100 (128 experts, top 8,
#: in a CUDA graph; ``benchmarks/bench_moe_kernel.py --pieces-only`` times these launches) it took 4.5 / 4.5 / 6.3 / 13.4 /
#: 30.3 us at 1 / 4 / 8 / 32 / 64 tokens against 4.7 / 4.8 / 5.3 / 6.2 / 6.9 us for the two launches.
ROUTE_ALIGN_PAYS_MAX_SLOTS = 32


def route_align_fits(tokens: int, num_experts: int, top_k: int, block_m: int) -> bool:
    """Whether the one-program kernel can take this batch at all (its tile holds every slot and
    every logit): what ``route_and_align_triton`` accepts."""
    slots = tokens * top_k
    return (0 < slots <= ROUTE_ALIGN_MAX_SLOTS and kernel_can_align(slots, block_m)
            and _next_power_of_2(tokens) * _next_power_of_2(num_experts) <= ROUTE_ALIGN_MAX_LOGITS)


def route_align_applies(tokens: int, num_experts: int, top_k: int, block_m: int) -> bool:
    """Whether ``route_and_align`` takes one launch for this batch (on CUDA): the kernel fits and
    is not slower than the two launches it replaces (``ROUTE_ALIGN_PAYS_MAX_SLOTS``)."""
    return tokens * top_k <= ROUTE_ALIGN_PAYS_MAX_SLOTS and route_align_fits(tokens, num_experts, top_k, block_m)
