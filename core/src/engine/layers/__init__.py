"""The layer SDK model plugins build on: one import surface.

``from engine.layers import RMSNorm, QKVParallelLinear, RadixAttention, ...`` gives every
public name listed in ``__all__`` (docs/plugins-reference.md, "The layer SDK", lists them with what
each is for). The modules themselves (``engine.layers.linear`` and so on) stay importable.

Names are resolved on first access (PEP 562): importing ``engine.layers`` imports neither
torch.distributed nor the sampler, so a plugin's registration module may import it cheaply.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module under engine (relative to ``engine.``) that defines it
_EXPORTS: dict[str, str] = {
    # activations on a gate+up projection of width 2d
    "SiluAndMul": "layers.activation",
    "GeluAndMul": "layers.activation",
    "get_act_and_mul": "layers.activation",
    # the gated (SwiGLU-style) feed-forward block
    "GatedMLP": "layers.mlp",
    # normalisation
    "RMSNorm": "layers.layernorm",
    "PendingNorm": "layers.layernorm",
    "normed_tensor": "layers.layernorm",
    # linear layers (tensor-parallel) and the hooks quant methods fill in
    "LinearBase": "layers.linear",
    "ReplicatedLinear": "layers.linear",
    "ColumnParallelLinear": "layers.linear",
    "MergedColumnParallelLinear": "layers.linear",
    "QKVParallelLinear": "layers.linear",
    "RowParallelLinear": "layers.linear",
    "UnquantizedLinearMethod": "layers.linear",
    "set_weight_attrs": "layers.linear",
    "QuantizationConfig": "layers.quantization",
    "LinearMethodBase": "layers.quantization",
    "FusedMoEMethodBase": "layers.quantization",
    # mixture of experts: the layer, its router, the per-expert torch reference (docs/moe.md)
    "FusedMoE": "layers.moe.layer",
    "UnquantizedFusedMoEMethod": "layers.moe.layer",
    "expert_params_mapping": "layers.moe.layer",
    "select_experts": "layers.moe.router",
    "fused_moe_reference": "layers.moe.reference",
    # positions
    "RotaryEmbedding": "layers.rotary_embedding",
    "get_rope": "layers.rotary_embedding",
    "rope_parameters": "layers.rotary_embedding",
    # embeddings, attention, output
    "VocabParallelEmbedding": "layers.vocab_parallel_embedding",
    "ParallelLMHead": "layers.vocab_parallel_embedding",
    "RadixAttention": "layers.radix_attention",
    "LogitsProcessor": "layers.logits_processor",
    "LogitsProcessorOutput": "layers.logits_processor",
    # pipeline parallelism: this stage's layers, placeholders, what passes between stages
    "make_layers": "layers.pipeline",
    "pp_layer_range": "layers.pipeline",
    "pp_stage": "layers.pipeline",
    "PPMissingLayer": "layers.pipeline",
    "PPProxyTensors": "layers.pipeline",
    # what a model's forward receives (built by the model executor)
    "ForwardBatch": "layers.forward_batch",
    "ForwardMode": "layers.forward_batch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.layers' has no attribute '{name}'; the layer SDK exports: "
                             f"{', '.join(__all__)}")
    value = getattr(importlib.import_module(f"engine.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from engine.layers.activation import GeluAndMul, SiluAndMul, get_act_and_mul
    from engine.layers.layernorm import PendingNorm, RMSNorm, normed_tensor
    from engine.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
        set_weight_attrs,
    )
    from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
    from engine.layers.mlp import GatedMLP
    from engine.layers.moe.layer import FusedMoE, UnquantizedFusedMoEMethod, expert_params_mapping
    from engine.layers.moe.reference import fused_moe_reference
    from engine.layers.moe.router import select_experts
    from engine.layers.pipeline import PPMissingLayer, PPProxyTensors, make_layers, pp_layer_range, pp_stage
    from engine.layers.quantization import FusedMoEMethodBase, LinearMethodBase, QuantizationConfig
    from engine.layers.radix_attention import RadixAttention
    from engine.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters
    from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from engine.layers.forward_batch import ForwardBatch, ForwardMode
