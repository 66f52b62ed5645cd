"""Grouped top-k routing: DeepSeek-V2/V3's router, for every ``FusedMoE`` path.

Experts are split into ``num_groups`` equal groups. Each token's scores (a softmax over all
experts, or V3's per-expert sigmoid) rank the groups, only the ``topk_groups`` best groups stay
eligible, and the ``top_k`` best experts among them are chosen. How a group is ranked: by its
best expert (V2's "group_limited_greedy") or by the sum of its two best (V3's "noaux_tc", where
a per-expert correction bias is added to the scores for the choice only: the weights are the
unbiased scores). The chosen weights are optionally renormalised to sum to one and then
multiplied by ``scaling_factor`` (DeepSeek's ``routed_scaling_factor``).

``FusedMoE(..., routing=GroupedTopK(...))`` routes this way instead of plain softmax top-k
(``select_experts``); the experts then run on the same paths (the torch reference, the fused
Triton kernel, expert parallelism). On CUDA (with triton installed) the routing is one Triton
launch (``engine.layers.moe.router_grouped_kernel``); elsewhere the torch operations of
``grouped_topk_reference``, which are also its test oracle. ``FusedMoE`` sends routing that is
plain softmax top-k (``GroupedTopK.is_softmax_topk``: DeepSeek-V2-Lite's "greedy") to
``select_experts``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.moe.router import triton_available

_SCORINGS = ("softmax", "sigmoid")
_GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class GroupedTopK:
    """How a grouped router picks experts (see the module docstring).

    Args:
        scoring: "softmax" (over all experts; DeepSeek-V2) or "sigmoid" (per expert; V3).
        num_groups: expert groups (``n_group``); 1 routes over all experts at once.
        topk_groups: groups each token may draw experts from (``topk_group``).
        group_score: "max" (a group's best score; V2) or "top2_sum" (its two best; V3).
        renormalize: rescale the chosen weights to sum to one (``norm_topk_prob``).
        scaling_factor: multiplies the final weights (``routed_scaling_factor``).
    """

    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    renormalize: bool = False
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in _SCORINGS:
            raise ValueError(f"GroupedTopK.scoring: invalid value {self.scoring!r}; accepted: {', '.join(_SCORINGS)}")
        if self.group_score not in _GROUP_SCORES:
            raise ValueError(f"GroupedTopK.group_score: invalid value {self.group_score!r}; accepted: "
                             f"{', '.join(_GROUP_SCORES)}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"GroupedTopK: topk_groups {self.topk_groups} of num_groups {self.num_groups}; accepted: "
                             "num_groups >= 1 and 1 <= topk_groups <= num_groups")

    @property
    def is_softmax_topk(self) -> bool:
        """Whether this routing is plain softmax top-k (``select_experts``'s: every group eligible,
        no scaling), which the one-launch router computes; with a correction bias it is not."""
        return self.scoring == "softmax" and self.topk_groups == self.num_groups and self.scaling_factor == 1.0

    def check_experts(self, num_experts: int, top_k: int) -> None:
        """Raises ``ValueError`` when ``num_experts`` do not split into the groups, or the eligible
        groups hold fewer than ``top_k`` experts."""
        if num_experts % self.num_groups:
            raise ValueError(f"grouped routing: {num_experts} experts do not split into n_group={self.num_groups} "
                             "equal groups; accepted: an n_group dividing the number of experts")
        per_group = num_experts // self.num_groups
        if self.group_score == "top2_sum" and self.num_groups > 1 and per_group < 2:
            raise ValueError(f"grouped routing: groups of {per_group} expert with the top-2 group score; accepted: "
                             "at least 2 experts per group")
        if self.topk_groups * per_group < top_k:
            raise ValueError(f"grouped routing: top_k={top_k} experts from topk_group={self.topk_groups} groups of "
                             f"{per_group}; accepted: topk_group * experts per group >= top_k")


def grouped_topk(router_logits: torch.Tensor, top_k: int, routing: GroupedTopK,
                 correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped top-k routing of every token.

    Args:
        router_logits: ``[tokens, num_experts]`` gate outputs, any float dtype (computed in float32).
        top_k: experts per token.
        routing: the router's rules.
        correction_bias: ``[num_experts]`` added to the scores for choosing only (V3's
            ``e_score_correction_bias``); None: none.

    Returns:
        ``(topk_weights, topk_ids)``: ``[tokens, top_k]`` float32 weights and int32 global expert ids.
    """
    if triton_available(router_logits):
        from engine.layers.moe.router_grouped_kernel import grouped_topk_triton

        return grouped_topk_triton(router_logits, top_k, routing, correction_bias)
    return grouped_topk_reference(router_logits, top_k, routing, correction_bias)


def grouped_topk_reference(router_logits: torch.Tensor, top_k: int, routing: GroupedTopK,
                           correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``grouped_topk`` in torch operations: the CPU path and the kernel's oracle."""
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    tokens, experts = choice.shape
    groups = routing.num_groups
    if groups > 1 and routing.topk_groups < groups:
        by_group = choice.view(tokens, groups, experts // groups)
        if routing.group_score == "max":
            group_scores = by_group.max(dim=-1).values
        else:
            group_scores = by_group.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(routing.topk_groups, dim=-1).indices
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        eligible = eligible.unsqueeze(-1).expand(-1, -1, experts // groups).reshape(tokens, experts)
        choice = choice.masked_fill(~eligible, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.scaling_factor != 1.0:
        weights = weights * routing.scaling_factor
    return weights, ids.to(torch.int32)
