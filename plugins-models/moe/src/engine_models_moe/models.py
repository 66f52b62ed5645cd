"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Attention is the Llama plugin's ``LlamaAttention`` (imported, not copied): it reads its
switches from ``config.model_type``, so each MoE family hands it a view of its config under
the dense sibling's type (Qwen2-MoE -> ``qwen2``: q/k/v bias; Qwen3-MoE -> ``qwen3``: per-head
q/k RMSNorm; Mixtral -> ``mixtral``: neither). The MLP of a sparse layer is a router (a
replicated linear gate) plus ``engine.layers.moe.FusedMoE``; Qwen2-MoE adds a shared expert
scaled by ``sigmoid(shared_expert_gate(x))``. Qwen layers listed in ``mlp_only_layers`` (or
off the ``decoder_sparse_step``) keep a dense MLP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import re

import torch
from engine_models_llama.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.layernorm import RMSNorm, normed_tensor
from engine.layers.linear import ReplicatedLinear
from engine.layers.mlp import GatedMLP
from engine.layers.moe import FusedMoE, expert_params_mapping
from engine.layers.quantization import QuantizationConfig
from engine.layers.radix_attention import kv_scale_target

# MoE model_type -> the dense model_type whose attention it shares (LlamaAttention's switches).
_ATTENTION_TYPE = {"mixtral": "mixtral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}


class _ConfigView:
    """``config`` with another ``model_type`` (every other attribute read through)."""

    def __init__(self, config: Any, model_type: str) -> None:
        self._config = config
        self.model_type = model_type

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def num_experts(config: Any) -> int:
    return int(getattr(config, "num_local_experts", None) or config.num_experts)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert)."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        experts = num_experts(config)
        mixtral = config.model_type == "mixtral"
        # The router stays in the model dtype (checkpoints quantize experts, not their gate).
        self.gate = ReplicatedLinear(config.hidden_size, experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            experts, config.num_experts_per_tok, config.hidden_size,
            config.intermediate_size if mixtral else config.moe_intermediate_size,
            renormalize=True if mixtral else bool(getattr(config, "norm_topk_prob", False)),
            quant_config=quant_config, prefix=f"{prefix}.experts")
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = (GatedMLP(config.hidden_size, shared, config.hidden_act, quant_config,
                                       f"{prefix}.shared_expert") if shared else None)
        self.shared_expert_gate = (ReplicatedLinear(config.hidden_size, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")
                                   if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The router reads the post-attention norm first: it may compute the norm itself
        # (MoeDecoderLayer.norm_consumers) and hand the experts its output.
        logits = self.gate(x)
        x = normed_tensor(x)
        out = self.experts(x, logits)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def _is_sparse(config: Any, layer_id: int) -> bool:
    if config.model_type == "mixtral":
        return True
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return layer_id not in (getattr(config, "mlp_only_layers", None) or []) and (layer_id + 1) % step == 0


class MoeDecoderLayer(LlamaDecoderLayer):
    """The Llama decoder layer with a sparse (or, on dense layers, gated) MLP under the checkpoint's name."""

    #: RMSNorm -> qkv_proj is the only producer feeding one linear (post-attention norm feeds the
    #: router and the experts).
    activation_consumers = {"input_layernorm": "self_attn.qkv_proj"}
    #: Set per layer in __init__: the post-attention norm -> the linear reading it first, which may
    #: compute the norm itself (engine.layers.quantization.fusion.link_norm_consumers): the router
    #: of a sparse layer (the experts read the norm after it), gate_up_proj of a dense one.
    norm_consumers: dict[str, str]

    def __init__(self, config: Any, layer_id: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: the MLP differs
        attn_config = _ConfigView(config, _ATTENTION_TYPE[config.model_type])
        self.self_attn = LlamaAttention(attn_config, layer_id, quant_config, f"{prefix}.self_attn")
        # Checkpoint names: Mixtral's block is block_sparse_moe, Qwen's mlp.
        self.mlp_name = "block_sparse_moe" if config.model_type == "mixtral" else "mlp"
        mlp: nn.Module
        if _is_sparse(config, layer_id):
            mlp = SparseMoeBlock(config, quant_config, f"{prefix}.{self.mlp_name}")
            first_reader = "gate"
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, quant_config,
                           f"{prefix}.{self.mlp_name}")
            first_reader = "gate_up_proj"
        setattr(self, self.mlp_name, mlp)
        self.norm_consumers = {"post_attention_layernorm": f"{self.mlp_name}.{first_reader}"}
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.mlp_name)(hidden)


class MoeModel(LlamaModel):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None) -> None:
        super().__init__(config, quant_config, MoeDecoderLayer)


_EXPERT_TENSOR = re.compile(r"experts\.\d+\.[^.]+\.")


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama plugin's causal-LM wrapper (forward, LM head, KV scales) around ``MoeModel``,
    with a loader that stacks expert tensors."""

    #: checkpoint names of an expert's gate, up and down projections.
    expert_names = ("gate_proj", "up_proj", "down_proj")
    #: LoRA adapters attach to the attention projections only (engine.lora.layers): the
    #: experts' weights live in fused MoE tensors, not in linear layers.
    lora_modules = ("qkv_proj", "o_proj")

    model_cls = MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        # "experts.{e}.{projection}." -> (parameter part, expert id, shard)
        experts = {ckpt: (param, e, shard) for param, ckpt, e, shard
                   in expert_params_mapping(num_experts(self.config), *self.expert_names)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name.startswith("lm_head.")):
                continue
            kv_scale = kv_scale_target(name)
            if kv_scale is not None:
                self._load_kv_scale(name, *kv_scale, tensor)
                continue
            target, args = self._target(name, experts)
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor '{name}' has no matching parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, *args)
            loaded.add(target)
        missing = sorted(n for n in params if n not in loaded and not (self.tie_word_embeddings and n.startswith("lm_head.")))
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} parameters, e.g. {', '.join(missing[:3])}")

    def _target(self, name: str, experts: dict[str, tuple[str, int, str]]) -> tuple[str, tuple[Any, ...]]:
        """Our parameter for checkpoint tensor ``name`` and the extra weight-loader arguments."""
        match = _EXPERT_TENSOR.search(name)
        if match is not None and match.group(0) in experts:
            # mlp.experts.3.w1.weight -> mlp.experts.w13_weight (expert 3, shard w1)
            param_part, expert_id, shard = experts[match.group(0)]
            return name[:match.start()] + param_part + name[match.end():], (expert_id, shard)
        for stacked, ckpt, shard_id in self.stacked_params:
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{stacked}."), (shard_id,)
        return name, ()


class MixtralForCausalLM(MoeForCausalLM):
    expert_names = ("w1", "w3", "w2")


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass


_CLASSES = {cls.__name__: cls for cls in (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)}


def model_class_for(architecture: str) -> type[nn.Module]:
    return _CLASSES[architecture]
