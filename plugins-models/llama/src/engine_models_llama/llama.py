"""Llama-family decoder built on the engine's layer SDK.

One implementation covers the four architectures; they differ only in switches
read from the config: Qwen2 puts a bias on q/k/v, Qwen3 normalises q and k per
head, Llama may bias every projection (``attention_bias``), Mistral and some
Qwen layers use a sliding window.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.distributed import get_tensor_model_parallel_world_size
from engine.errors import ModelLoadError
from engine.layers.hidden_capture import record_layer_output
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.layers.mlp import GatedMLP
from engine.layers.pipeline import PPMissingLayer, PPProxyTensors, make_layers, pp_stage
from engine.layers.quantization import QuantizationConfig
from engine.layers.radix_attention import RadixAttention, kv_scale_target
from engine.layers.rotary_embedding import get_rope
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model_executor.forward_batch import ForwardBatch


def _sliding_window(config: Any, layer_id: int) -> int:
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None:
        return int(window) if layer_types[layer_id] == "sliding_attention" and window else -1
    if config.model_type == "mistral" and window:
        return int(window)
    return -1


class LlamaMLP(GatedMLP):
    """The core's ``GatedMLP`` sized from a Llama-family config (``mlp_bias`` biases both linears)."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act, quant_config, prefix,
                         bias=bool(getattr(config, "mlp_bias", False)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.total_heads = config.num_attention_heads
        self.total_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.total_heads
        self.num_heads = self.total_heads // tp
        self.num_kv_heads = max(1, self.total_kv_heads // tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        model_type = config.model_type
        all_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = all_bias or model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.total_heads, self.total_kv_heads,
            bias=qkv_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(
            self.total_heads * self.head_dim, config.hidden_size, bias=all_bias,
            quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.qk_norm = model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config)
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id,
            sliding_window_size=_sliding_window(config, layer_id))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        # q/k norm (Qwen3), rotary and the KV store: one fused launch at decode where the platform has it.
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        return self.o_proj(self.attn.forward_qkv(qkv, positions, forward_batch, self.rotary_emb, q_norm, k_norm))


class LlamaDecoderLayer(nn.Module):
    #: Each producer's output is read only by that linear: a quantization method may have it
    #: come quantized (engine.layers.quantization.fusion).
    activation_consumers = {"input_layernorm": "self_attn.qkv_proj",
                            "post_attention_layernorm": "mlp.gate_up_proj",
                            "mlp.act_fn": "mlp.down_proj"}

    def __init__(self, config: Any, layer_id: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, quant_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The block after the post-attention norm (subclasses with another MLP override it)."""
        return self.mlp(hidden)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None,
                 layer_cls: type[nn.Module] | None = None) -> None:
        super().__init__()
        layer_cls = layer_cls or LlamaDecoderLayer
        # Pipeline parallelism: this stage builds only its layers (the first also embeds, the
        # last also norms); the rest are placeholders.
        self.stage = pp_stage()
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if self.stage.is_first else PPMissingLayer())
        self.layers, self.start_layer, self.end_layer = make_layers(
            config.num_hidden_layers, lambda i, prefix: layer_cls(config, i, quant_config, prefix),
            prefix="model.layers")
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.stage.is_last else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor | PPProxyTensors:
        if self.stage.is_first:
            # A vision-language model's prefill arrives embedded (engine.multimodal).
            embeds = forward_batch.input_embeds
            hidden, residual = (self.embed_tokens(input_ids) if embeds is None else embeds), None
        else:
            assert forward_batch.pp_proxy is not None
            hidden, residual = forward_batch.pp_proxy.hidden_states, forward_batch.pp_proxy.residual
        for layer_id in range(self.start_layer, self.end_layer):
            hidden, residual = self.layers[layer_id](positions, hidden, residual, forward_batch)
            record_layer_output(forward_batch, layer_id, hidden, residual)  # EAGLE-3 features, when asked
        if not self.stage.is_last:
            return PPProxyTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our stacked parameter, shard id)
    stacked_params = (
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )

    #: the decoder stack (subclasses with other layers set their own).
    model_cls: type[nn.Module] = LlamaModel
    #: checkpoint names of the heads over the decoder (a classification model's ``score.``).
    head_prefixes: tuple[str, ...] = ("lm_head.",)

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, quant_config)
        stage = self.model.stage
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if stage.is_last else PPMissingLayer()
        # Split over pipeline stages, a tied LM head is its own copy of the embedding (the loader
        # hands it the embedding's tensor under the name lm_head.weight).
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)) and stage.size == 1
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput | PPProxyTensors:
        hidden = self.model(input_ids, positions, forward_batch)
        if isinstance(hidden, PPProxyTensors):
            return hidden
        return self.logits_processor(hidden, self.lm_head, forward_batch)

    @torch.no_grad()
    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       forward_batch: ForwardBatch) -> torch.Tensor:
        """The final (normed) state of every token, for pooling (``--task embed``: Qwen3-Embedding,
        gte-Qwen). Pooling models run on one pipeline stage."""
        hidden = self.model(input_ids, positions, forward_batch)
        assert not isinstance(hidden, PPProxyTensors), "pooling runs without pipeline parallelism"
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if not name.startswith(("model.", *self.head_prefixes)):
                # Embedding checkpoints saved from the bare decoder (Qwen3-Embedding, gte-Qwen)
                # name its tensors without the "model." prefix.
                name = f"model.{name}"
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue
            kv_scale = kv_scale_target(name)
            if kv_scale is not None:
                # A per-tensor KV-cache scale: kept by the layer's RadixAttention, used when the KV
                # cache is stored in fp8 (the engine decides; the model does not need to know).
                self._load_kv_scale(name, *kv_scale, tensor)
                continue
            target, shard = name, None
            for stacked, ckpt, shard_id in self.stacked_params:
                if f".{ckpt}." in name:
                    target, shard = name.replace(f".{ckpt}.", f".{stacked}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor '{name}' has no matching parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        # A bare decoder (embedding checkpoints) has no LM head: it can pool but not generate.
        self.has_lm_head = self.tie_word_embeddings or "lm_head.weight" in loaded
        missing = sorted(n for n in params if n not in loaded and not n.startswith("lm_head."))
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} parameters, e.g. {', '.join(missing[:3])}")

    def _load_kv_scale(self, name: str, prefix: str, kind: str, tensor: torch.Tensor) -> None:
        try:
            attn = self.get_submodule(f"{prefix}.attn")
        except AttributeError:
            attn = None
        if not isinstance(attn, RadixAttention):
            raise ModelLoadError(f"checkpoint tensor '{name}' (a KV-cache scale) names no attention layer of "
                                 f"{type(self).__name__} (expected one at '{prefix}')")
        attn.load_kv_scale(kind, tensor)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


_CLASSES = {cls.__name__: cls for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)}


def model_class_for(architecture: str) -> type[nn.Module]:
    return _CLASSES[architecture]
