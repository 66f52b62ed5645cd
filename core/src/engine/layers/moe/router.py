"""The router: which experts each token goes to, and with what weight.

Mixtral, Qwen2-MoE and Qwen3-MoE route the same way: a linear gate gives one logit per expert,
a softmax over all experts (in float32) turns them into probabilities, the ``top_k`` largest
are kept, and (Mixtral always; Qwen when its config's ``norm_topk_prob`` is set) they are
renormalised to sum to one.

On CUDA (with triton installed) the whole computation is one Triton launch
(``engine.layers.moe.router_kernel``); elsewhere the torch operations below, which are also its
test oracle.
"""

from __future__ import annotations

import torch


def triton_available(x: torch.Tensor) -> bool:
    """Whether this package's Triton kernels can run on ``x``'s device (CUDA with triton installed)."""
    if not x.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing.

    Args:
        router_logits: ``[tokens, num_experts]``, any float dtype.
        top_k: experts per token.
        renormalize: rescale the ``top_k`` probabilities of each token to sum to one.
        pdl: (CUDA, sm_90+) launch with programmatic dependent launch: the kernel waits for the
            previous one (the router's GEMM) and then lets the next one start.

    Returns:
        ``(topk_weights, topk_ids)``: ``[tokens, top_k]`` float32 weights and int32 global
        expert ids, highest weight first (on CUDA, equal weights: the lower expert id first).
    """
    if triton_available(router_logits):
        from engine.layers.moe.router_kernel import select_experts_triton

        return select_experts_triton(router_logits, top_k, renormalize, pdl=pdl)
    return select_experts_reference(router_logits, top_k, renormalize)


def select_experts_reference(router_logits: torch.Tensor, top_k: int,
                             renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts`` in torch operations: the CPU path and the kernel's oracle."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
