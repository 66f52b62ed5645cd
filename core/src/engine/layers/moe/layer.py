"""``FusedMoE``: a mixture-of-experts layer of the layer SDK, tensor- and expert-parallel.

The layer holds every expert's weights stacked: ``w13_weight`` ``[E_local, 2 * I_local, H]``
(gate rows, then up rows) and ``w2_weight`` ``[E_local, H, I_local]``, filled at load time from
the checkpoint's per-expert tensors (``experts.{e}.w1/w3/w2`` or ``gate/up/down_proj``; see
``expert_params_mapping``). Its forward takes the hidden states and the router's logits, picks
``top_k`` experts per token (``select_experts``) and runs them through its quant method
(``UnquantizedFusedMoEMethod``, or a quant plugin's ``FusedMoEMethodBase``). At decode sizes on
CUDA, for a method with ``takes_expert_blocks``, routing, the mapping to this rank's expert ids
and the kernel's slot alignment are one launch (``route_and_align``); the alignment reaches the
method as ``layer.expert_blocks`` (``FusedMoEMethodBase.apply`` has no argument for it). At batches
of 1-2 tokens (``small_batch_applies``) the router runs alone: ``fused_moe`` then needs no alignment;
there, shared experts every token goes through (DeepSeek's, one SwiGLU MLP) can run in the routed
experts' two launches (``fuses_shared`` / ``forward(..., shared=...)``).

Parallelism. With ``tp`` tensor-parallel ranks of which ``ep`` form the expert-parallel split
(``--ep-size``, a divisor of ``--tp-size``): expert-parallel rank ``tp_rank // (tp / ep)`` holds
experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``, and within it each of the ``tp / ep``
ranks holds ``I / (tp / ep)`` of every such expert's intermediate features. Tokens are
replicated across tensor-parallel ranks already, so every rank computes its share of every
token's output (zero for experts it does not hold) and one all-reduce over the
tensor-parallel group sums them: the same collective the row-parallel ``down_proj`` of a dense
MLP uses, so EP adds no communication of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.distributed import (
    divide,
    get_expert_parallel_world_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from engine.layers.linear import set_weight_attrs
from engine.layers.moe.align import ExpertBlocks
from engine.layers.moe.reference import fused_moe_reference
from engine.layers.moe.route_align import route_align_applies, route_and_align, to_local_expert_ids
from engine.layers.moe.router import select_experts, triton_available
from engine.layers.moe.router_grouped import GroupedTopK, grouped_topk
from engine.layers.quantization import FusedMoEMethodBase, QuantizationConfig, is_layer_ignored


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Expert weights in the model dtype; the fused Triton kernel on CUDA, the torch reference
    elsewhere."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        inter = intermediate_size_per_partition
        w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=params_dtype), requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=params_dtype), requires_grad=False)
        for param in (w13, w2):
            set_weight_attrs(param, {"weight_loader": weight_loader})
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    #: ``apply`` hands ``layer.expert_blocks`` to the kernel: ``FusedMoE`` may then compute the
    #: alignment in the router's launch (``route_and_align``). A method without this attribute
    #: gets routing alone and aligns inside ``fused_moe``.
    takes_expert_blocks = True

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if triton_available(x):
            from engine.layers.moe.fused_moe import fused_moe

            return fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                             act_fn=getattr(layer, "act_fn", None), blocks=getattr(layer, "expert_blocks", None),
                             pdl=getattr(layer, "pdl", False), shared=getattr(layer, "shared_weights", None))
        return fused_moe_reference(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)


def expert_params_mapping(num_experts: int, gate: str = "gate_proj", up: str = "up_proj",
                          down: str = "down_proj") -> list[tuple[str, str, int, str]]:
    """How checkpoint expert tensors map onto a ``FusedMoE``'s stacked parameters.

    Returns ``(parameter fragment, checkpoint fragment, expert id, shard)`` tuples: a checkpoint
    name containing ``experts.{e}.{gate}.`` loads into ``experts.w13_weight`` as shard ``"w1"`` of
    expert ``e``. Mixtral names its projections ``w1``/``w3``/``w2``; Qwen ``gate_proj``/
    ``up_proj``/``down_proj`` (the defaults).
    """
    return [(f"experts.{'w2' if shard == 'w2' else 'w13'}_", f"experts.{e}.{name}.", e, shard)
            for e in range(num_experts)
            for name, shard in ((gate, "w1"), (up, "w3"), (down, "w2"))]


class FusedMoE(nn.Module):
    """The routed experts of one MoE block.

    Args:
        num_experts: experts in the model (all ranks together).
        top_k: experts per token.
        hidden_size, intermediate_size: of one expert (``intermediate_size`` unsplit).
        renormalize: renormalise the top-k routing weights (Mixtral; Qwen's ``norm_topk_prob``).
        quant_config: the model's quantization; its ``get_moe_method`` may quantize the experts.
        prefix: the layer's checkpoint prefix (``model.layers.3.mlp.experts``).
        reduce_results: all-reduce the output over the tensor-parallel group; False leaves each
            rank's partial sum (for a caller that adds more before one reduction).
        routing: grouped top-k routing (DeepSeek; ``engine.layers.moe.router_grouped``) instead of
            softmax top-k; ``renormalize`` is then ``routing.renormalize``.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None, reduce_results: bool = True,
                 routing: GroupedTopK | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        if routing is not None:
            routing.check_experts(num_experts, top_k)
            renormalize = routing.renormalize
        self.routing = routing
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        #: An activation-and-mul for ``fused_moe`` (``[slots, 2I] -> [slots, I]``) when the experts'
        #: activation is not SwiGLU; None: SiLU-and-mul in the gate/up launch's epilogue.
        self.act_fn: Any = None
        #: During ``forward`` only: the alignment ``route_and_align`` computed with the routing
        #: (decode sizes on CUDA, for a quant method with ``takes_expert_blocks``), else None.
        self.expert_blocks: ExpertBlocks | None = None
        #: During ``forward`` only: the shared experts' weights the kernel runs with the routed ones.
        self.shared_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        #: Programmatic dependent launch for the router's top-k and the small-batch expert launches
        #: (the platform's ``pdl`` layer-kernel entry, ``use_kernels``); quant methods pass it on.
        self.pdl = False
        self.tp_size = get_tensor_model_parallel_world_size()
        tp_rank = get_tensor_model_parallel_rank()
        self.ep_size = get_expert_parallel_world_size()
        # Ranks sharing one expert-parallel rank's experts split their intermediate features.
        self.moe_tp_size = divide(self.tp_size, self.ep_size)
        self.moe_tp_rank = tp_rank % self.moe_tp_size
        self.ep_rank = tp_rank // self.moe_tp_size
        self.num_local_experts = divide(num_experts, self.ep_size)
        self.expert_start = self.ep_rank * self.num_local_experts
        self.intermediate_size_per_partition = divide(intermediate_size, self.moe_tp_size)
        method = None
        if quant_config is not None and not is_layer_ignored(prefix, quant_config.ignored_layers()):
            method = quant_config.get_moe_method(self, prefix)
        self.quant_method: FusedMoEMethodBase = method or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, self.num_local_experts, hidden_size,
                                         self.intermediate_size_per_partition,
                                         params_dtype or torch.get_default_dtype(), self.weight_loader)

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's ``pdl`` entry: whether its kernels may use programmatic dependent launch."""
        self.pdl = bool(kernels.get("pdl", False))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str) -> None:
        """Copies checkpoint tensor ``loaded`` (expert ``expert_id``'s ``w1``, ``w3`` or ``w2``,
        full size) into this rank's slice of ``param``; experts held elsewhere are skipped."""
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        inter = self.intermediate_size_per_partition
        start = self.moe_tp_rank * inter
        if shard_id == "w2":
            src = loaded.narrow(1, start, inter) if loaded.shape[1] != inter else loaded
            dst = param.data[local]
        elif shard_id in ("w1", "w3"):
            src = loaded.narrow(0, start, inter) if loaded.shape[0] != inter else loaded
            dst = param.data[local].narrow(0, 0 if shard_id == "w1" else inter, inter)
        else:
            raise ValueError(f"FusedMoE: unknown expert shard '{shard_id}'; accepted: w1, w3, w2")
        if dst.shape != src.shape:
            raise ValueError(f"expert weight shape mismatch: parameter {tuple(dst.shape)}, checkpoint {tuple(src.shape)}")
        dst.copy_(src)

    def local_expert_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's (``-1`` where another expert-parallel rank holds it)."""
        if self.ep_size == 1:
            return topk_ids
        return to_local_expert_ids(topk_ids, self.expert_start, self.num_local_experts)

    def _grouped(self, correction_bias: torch.Tensor | None) -> bool:
        """Whether this call routes through ``grouped_topk``: grouped routing that is not plain
        softmax top-k (DeepSeek-V2-Lite's "greedy" is; it then takes the one-launch router)."""
        return self.routing is not None and (correction_bias is not None or not self.routing.is_softmax_topk)

    def _route_align_block_m(self, router_logits: torch.Tensor, grouped: bool) -> int | None:
        """``BLOCK_M`` of the kernel's tiles when routing and alignment take one launch for this
        batch (CUDA, decode sizes, a quant method that takes the blocks); None otherwise."""
        if grouped or not (getattr(self.quant_method, "takes_expert_blocks", False)
                           and triton_available(router_logits)):
            return None  # grouped routing has its own router
        from engine.layers.moe.fused_moe import pick_blocks
        from engine.layers.moe.small_batch import small_batch_applies

        tokens = router_logits.shape[0]
        if small_batch_applies(tokens, self.top_k, self.num_local_experts):
            return None  # fused_moe takes its small-batch path: no alignment to compute
        block_m = pick_blocks(tokens * self.top_k, self.num_local_experts)["BLOCK_M"]
        applies = route_align_applies(tokens, router_logits.shape[1], self.top_k, block_m)
        return block_m if applies else None

    def fuses_shared(self, hidden: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        """Whether ``forward(hidden, ..., shared=shared)`` may run these shared experts (one SwiGLU
        MLP's ``(gate_up weight [2 * S * I, H], down weight [H, S * I])``, unquantized) in the routed
        experts' launches: on CUDA, unquantized experts with SwiGLU, a batch the small-batch kernels
        take (``small_batch_applies``), and shared weights that split into whole ``I``-row chunks."""
        if shared is None or type(self.quant_method) is not UnquantizedFusedMoEMethod or self.act_fn is not None:
            return False
        if not triton_available(hidden):
            return False
        from engine.layers.moe.small_batch import shared_chunks, small_batch_applies

        return (small_batch_applies(hidden.shape[0], self.top_k, self.num_local_experts)
                and shared_chunks(shared[0], shared[1], self.w13_weight) > 0)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``correction_bias``: with grouped routing, the per-expert bias added to the scores for
        the choice (DeepSeek-V3's ``e_score_correction_bias``). ``shared``: shared experts' weights
        to add in the same launches, only where ``fuses_shared`` says so (a ValueError otherwise);
        the output is then the routed experts' plus the shared MLP's."""
        if shared is not None and not self.fuses_shared(hidden, shared):
            raise ValueError(f"FusedMoE: shared experts {tuple(shared[0].shape)}, {tuple(shared[1].shape)} for "
                             f"{hidden.shape[0]} tokens on {hidden.device.type}; accepted only where fuses_shared "
                             "is true (CUDA, unquantized SwiGLU experts, small batches, whole chunks)")
        grouped = self._grouped(correction_bias)
        block_m = self._route_align_block_m(router_logits, grouped)
        if grouped:
            assert self.routing is not None
            topk_weights, topk_ids = grouped_topk(router_logits, self.top_k, self.routing, correction_bias)
            topk_ids = self.local_expert_ids(topk_ids)
        elif block_m is not None:
            topk_weights, topk_ids, self.expert_blocks = route_and_align(
                router_logits, self.top_k, self.renormalize, block_m, self.expert_start, self.num_local_experts)
        else:
            topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize, pdl=self.pdl)
            topk_ids = self.local_expert_ids(topk_ids)
        self.shared_weights = shared
        try:
            out = self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        finally:
            self.expert_blocks = None
            self.shared_weights = None
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
