"""DeepSeek-V2 and DeepSeek-V3 decoders.

Attention is multi-head latent attention (``engine_models_deepseek.mla``; the model declares
``kv_layout = "mla"``, so the engine gives it an ``MLATokenToKVPool`` and an attention backend
that reads that layout). The first ``first_k_dense_replace`` layers (and, with
``moe_layer_freq > 1``, the layers off that stride) have a dense SwiGLU MLP; the others a
mixture of experts: a float32 router, ``FusedMoE`` with grouped top-k routing
(``engine.layers.moe.GroupedTopK``) and ``n_shared_experts`` shared experts every token goes
through. Routing by ``topk_method``: "greedy" (V2: softmax top-k), "group_limited_greedy" (V2:
softmax, groups ranked by their best expert), "noaux_tc" (V3: sigmoid scores plus
``e_score_correction_bias`` for the choice, groups ranked by their two best experts).

The decoder stack, LM head and pipeline split are the Llama plugin's; the loader (stacked
experts, KV scales) the MoE plugin's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from engine_models_llama.llama import LlamaDecoderLayer, LlamaModel
from engine_models_moe.models import MoeForCausalLM
from torch import nn

from engine.distributed import data_parallel_mlp, get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from engine.errors import ModelLoadError
from engine.layers.layernorm import PendingNorm, RMSNorm, normed_tensor
from engine.layers.mlp import GatedMLP
from engine.layers.moe import FusedMoE, GroupedTopK
from engine.layers.quantization import QuantizationConfig
from engine_models_deepseek.mla import DeepseekMLA, plain_linear

_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
#: Decode batches up to this many tokens compute the router's logits in one launch
#: (``gate_kernel.MAX_TOKENS``; a literal here so the CPU path does not import triton).
GATE_KERNEL_MAX_TOKENS = 8


def routing_for(config: Any) -> GroupedTopK:
    """The router's rules from a DeepSeek config (``topk_method``, ``scoring_func``, ``n_group``,
    ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``)."""
    v3 = config.model_type == "deepseek_v3"
    method = getattr(config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
    if method not in _TOPK_METHODS:
        raise ModelLoadError(f"config topk_method: invalid value {method!r}; accepted: {', '.join(_TOPK_METHODS)}")
    scoring = getattr(config, "scoring_func", None) or ("sigmoid" if method == "noaux_tc" else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise ModelLoadError(f"config scoring_func: invalid value {scoring!r}; accepted: softmax, sigmoid")
    renormalize = bool(getattr(config, "norm_topk_prob", False))
    scaling = float(getattr(config, "routed_scaling_factor", None) or 1.0)
    if not v3 and renormalize:
        scaling = 1.0  # DeepSeek-V2 scales the weights only when it does not renormalise them
    if method == "greedy":
        return GroupedTopK(scoring, renormalize=renormalize, scaling_factor=scaling)
    groups = int(getattr(config, "n_group", None) or 1)
    return GroupedTopK(scoring, groups, int(getattr(config, "topk_group", None) or groups),
                       "max" if method == "group_limited_greedy" else "top2_sum", renormalize, scaling)


class DeepseekGate(nn.Module):
    """The router: float32 logits (the checkpoints keep it unquantized) and V3's correction bias."""

    #: Where the platform allows: the logits' launch as a programmatic dependent one, and the
    #: RMSNorm before it folded in; False keeps each off (the comparison a benchmark makes).
    kernel_pdl = True
    fold_norm = True

    def __init__(self, num_experts: int, hidden_size: int, with_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
                                        if with_bias else None)
        self.pdl = False
        self.norm_fusion = False

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's ``pdl`` entry (the one-launch logits as a programmatic dependent
        launch) and its skinny GEMM's ``norm_fusion`` (the kernel may take the norm before it)."""
        self.pdl = self.kernel_pdl and bool(kernels.get("pdl", False))
        self.norm_fusion = self.fold_norm and bool(getattr(kernels.get("linear"), "norm_fusion", False))

    def can_fuse_norm(self) -> bool:
        """Whether the RMSNorm before the router may hand it ``PendingNorm`` inputs (the layer SDK's
        ``norm_consumers`` linking asks once): where the platform folds norms into its GEMMs."""
        return self.norm_fusion

    def takes_pending_norm(self, x: torch.Tensor) -> bool:
        """Per call: one 16-bit contiguous row on the GPU (batch-1 decode, as the skinny GEMM's fold)."""
        return (self.norm_fusion and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
                and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1)

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        # One launch instead of a cast and a two-kernel GEMV; a pending norm is computed in it too.
        if isinstance(x, PendingNorm) or (x.is_cuda and 0 < x.shape[0] <= GATE_KERNEL_MAX_TOKENS
                                          and x.stride(-1) == 1):
            from engine_models_deepseek.gate_kernel import gate_logits

            return gate_logits(x, self.weight, pdl=self.pdl)
        return F.linear(x.float(), self.weight)


class DeepseekMoE(nn.Module):
    """Routed experts (``FusedMoE``) plus the shared ones (a SwiGLU ``GatedMLP``). At the batches
    the small-batch expert kernels take (decode of one or two tokens on CUDA), unquantized shared
    experts run in the routed experts' two launches as extra slots of weight 1 (``FusedMoE.fuses_shared``):
    one weight stream instead of five more launches (two GEMVs, the activation, the add)."""

    #: Shared experts in the routed launches where ``FusedMoE.fuses_shared`` allows; False always
    #: runs them as their own MLP (the comparison a benchmark makes).
    fuse_shared_experts = True

    def __init__(self, config: Any, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        experts = int(config.n_routed_experts)
        routing = routing_for(config)
        self.gate = DeepseekGate(experts, config.hidden_size, with_bias=routing.group_score == "top2_sum")
        # One all-reduce for routed and shared experts together: each leaves its partial sum.
        self.experts = FusedMoE(experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size,
                                routing.renormalize, quant_config=quant_config, prefix=f"{prefix}.experts",
                                reduce_results=False, routing=routing)
        shared = int(getattr(config, "n_shared_experts", None) or 0)
        self.shared_experts = (GatedMLP(config.hidden_size, config.moe_intermediate_size * shared, config.hidden_act,
                                        quant_config, f"{prefix}.shared_experts", reduce_results=False)
                               if shared else None)
        self.tp_size = get_tensor_model_parallel_world_size()
        self.silu = config.hidden_act == "silu"

    def _shared_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared experts' weights where the routed launches may run them, else None."""
        mlp = self.shared_experts
        if mlp is None or not self.fuse_shared_experts or not self.silu:
            return None
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        if not (plain_linear(gate_up) and plain_linear(down)):
            return None
        shared = (gate_up.weight, down.weight)
        return shared if self.experts.fuses_shared(x, shared) else None

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        logits = self.gate(x)
        x = normed_tensor(x)  # a norm folded into the router: its output, written by the gate's launch
        shared = self._shared_weights(x)
        out = self.experts(x, logits, self.gate.e_score_correction_bias, shared=shared)
        if self.shared_experts is not None and shared is None:
            out = out + self.shared_experts(x)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


def is_moe_layer(config: Any, layer_id: int) -> bool:
    freq = int(getattr(config, "moe_layer_freq", None) or 1)
    return bool(getattr(config, "n_routed_experts", None)) and layer_id >= int(
        getattr(config, "first_k_dense_replace", 0) or 0) and layer_id % freq == 0


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """The Llama decoder layer with MLA and a dense or mixture-of-experts MLP."""

    # Both norms feed several layers (q and the latent; router, experts and shared experts): the
    # instance declares their first readers once post_load_weights fused q and the latent.
    activation_consumers: dict[str, str] = {}
    norm_consumers: dict[str, str] = {}

    def __init__(self, config: Any, layer_id: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: attention and MLP differ
        self.self_attn = DeepseekMLA(config, layer_id, quant_config, f"{prefix}.self_attn")
        # DP attention: the MLP splits across the data-parallel replicas (engine.distributed.dp_attention).
        self.mlp: nn.Module = data_parallel_mlp(
            lambda: DeepseekMoE(config, quant_config, f"{prefix}.mlp") if is_moe_layer(config, layer_id)
            else GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, quant_config, f"{prefix}.mlp"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekModel(LlamaModel):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None) -> None:
        super().__init__(config, quant_config, DeepseekDecoderLayer)


class DeepseekV2ForCausalLM(MoeForCausalLM):
    """DeepSeek-V2 (and V2-Lite: no ``q_lora_rank``)."""

    #: the engine builds an ``MLATokenToKVPool`` and selects an attention backend reading "mla".
    kv_layout = "mla"
    model_cls = DeepseekModel
    # Only the MLPs stack checkpoint tensors (MLA's projections load one to one).
    stacked_params = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    # LoRA targets: none (the attention's projections are not the layouts engine.lora adapts).
    lora_modules: tuple[str, ...] = ()

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, quant_config)
        # What the model runner sizes the MLA pool and the backend's shapes from.
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.qk_rope_head_dim = int(config.qk_rope_head_dim)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._decoder_weights(weights))

    def _decoder_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint without its multi-token-prediction layers (V3's ``model.layers.61``,
        numbered after the decoder's), which only speculative drafting would read."""
        layers = int(self.config.num_hidden_layers)
        for name, tensor in weights:
            parts = name.split(".")
            if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= layers:
                continue
            yield name, tensor

    def post_load_weights(self) -> None:
        """MLA's absorbed ``W_UK``/``W_UV`` from the loaded (and quant-processed) ``kv_b_proj``, and
        its two input projections as one linear where they fuse (the input norm's consumer then)."""
        for module in self.modules():
            if isinstance(module, DeepseekMLA):
                module.absorb_kv_b_proj()
                module.fuse_input_projections()
        for module in self.modules():
            if isinstance(module, DeepseekDecoderLayer):
                # Each norm's first reader, where there is one (the instance's declaration;
                # link_norm_consumers runs after loading): the fused input projection; the router
                # (the experts then read the norm output its launch wrote), or the dense MLP's gate_up.
                consumers = {}
                if module.self_attn.input_proj is not None:
                    consumers["input_layernorm"] = "self_attn.input_proj"
                if getattr(module.mlp, "dp_attention_mlp", False):
                    pass  # DP attention gathers the MLP's input across replicas: a tensor, not a pending norm
                elif isinstance(module.mlp, DeepseekMoE):
                    consumers["post_attention_layernorm"] = "mlp.gate"
                elif isinstance(module.mlp, GatedMLP):
                    consumers["post_attention_layernorm"] = "mlp.gate_up_proj"
                module.norm_consumers = consumers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: sigmoid routing with the correction bias, ``rope_interleave``."""


_CLASSES = {cls.__name__: cls for cls in (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)}


def model_class_for(architecture: str) -> type[nn.Module]:
    return _CLASSES[architecture]
