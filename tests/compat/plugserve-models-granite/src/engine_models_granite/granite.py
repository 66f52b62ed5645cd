"""GraniteForCausalLM on the engine's layer SDK.

Granite is Llama with four scalars from config.json: token embeddings are multiplied by
``embedding_multiplier``, attention scores use ``attention_multiplier`` as the softmax scale,
each block's output is multiplied by ``residual_multiplier`` before the residual add, and the
logits are divided by ``logits_scaling``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.distributed import get_tensor_model_parallel_world_size
from engine.layers.activation import SiluAndMul
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.layers.radix_attention import RadixAttention
from engine.layers.rotary_embedding import get_rope
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model_executor.forward_batch import ForwardBatch


class GraniteMLP(nn.Module):
    def __init__(self, config: Any, quant_config: Any, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GraniteAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, quant_config: Any, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // heads
        self.q_size = heads // tp * self.head_dim
        self.kv_size = max(1, kv_heads // tp) * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias=False,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=False,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config)
        self.attn = RadixAttention(heads // tp, self.head_dim, config.attention_multiplier, max(1, kv_heads // tp),
                                   layer_id)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous(), forward_batch))


class GraniteDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, quant_config: Any, prefix: str) -> None:
        super().__init__()
        self.residual_multiplier = config.residual_multiplier
        self.self_attn = GraniteAttention(config, layer_id, quant_config, f"{prefix}.self_attn")
        self.mlp = GraniteMLP(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        # The multiplier scales each block's output before the residual add, so the residual is
        # added here rather than inside RMSNorm.
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), forward_batch) * self.residual_multiplier
        return hidden + self.mlp(self.post_attention_layernorm(hidden)) * self.residual_multiplier


class GraniteForCausalLM(nn.Module):
    # checkpoint projection -> (our fused parameter, shard id)
    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, config: Any, quant_config: Any = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GraniteDecoderLayer(config, i, quant_config, f"model.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        hidden = self.embed_tokens(input_ids) * self.config.embedding_multiplier
        for layer in self.layers:
            hidden = layer(positions, hidden, forward_batch)
        # Dividing the final hidden state divides the logits: the LM head is linear.
        hidden = self.norm(hidden) / self.config.logits_scaling
        return self.logits_processor(hidden, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (self.config.tie_word_embeddings and name.startswith("lm_head.")):
                continue
            shard = None
            for fused, projection, shard_id in self.stacked_params:
                if f".{projection}." in name:
                    name, shard = name.replace(f".{projection}.", f".{fused}."), shard_id
                    break
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
