"""The router: which experts each token goes to, and with what weight.

Mixtral, Qwen2-MoE and Qwen3-MoE route the same way: a linear gate gives one logit per expert,
a softmax over all experts (in float32) turns them into probabilities, the ``top_k`` largest
are kept, and (Mixtral always; Qwen when its config's ``norm_topk_prob`` is set) they are
renormalised to sum to one.
"""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing.

    Args:
        router_logits: ``[tokens, num_experts]``, any float dtype.
        top_k: experts per token.
        renormalize: rescale the ``top_k`` probabilities of each token to sum to one.

    Returns:
        ``(topk_weights, topk_ids)``: ``[tokens, top_k]`` float32 weights and int32 global
        expert ids, highest weight first.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
