"""EAGLE draft heads in their two published layouts, built on the layer SDK.

- **EAGLE-1/2** (``fc.weight`` ``[H, 2H]`` (+ ``fc.bias``), ``layers.0.*``, optional
  ``embed_tokens.weight``): ``x = fc([embed(token); feature])`` with ``feature`` the target's
  final hidden state (the LM head's input) or the head's own previous output; one Llama decoder
  layer whose input norm is skipped; its output (no final norm) goes through the target's LM
  head and is also the next step's feature.
- **EAGLE-3** (``midlayer.*``, ``fc.weight`` ``[H, 3H]`` over three target layers' outputs,
  ``norm.weight``, ``lm_head.weight`` over a draft vocabulary, ``d2t``): the feature is
  ``fc(aux)`` when it comes from the target (``3H`` wide) and the head's own pre-norm output
  after that; the layer's attention reads ``[input_norm(embed); hidden_norm(feature)]`` (``2H``)
  with the feature as residual; logits are ``lm_head(norm(out))`` over the draft vocabulary,
  mapped to target ids by ``d2t`` (``target = draft + d2t[draft]``).

Only one-layer heads (every published EAGLE/EAGLE-3 Llama head) are supported.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import QKVParallelLinear
from engine.model_executor.forward_batch import ForwardBatch
from engine_models_llama.llama import LlamaAttention, LlamaMLP

_STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def read_head_config(path: str) -> Any:
    """The head's ``config.json`` as a transformers ``LlamaConfig`` (extra keys kept)."""
    import transformers

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"--speculative-draft-model-path {path}: no config.json (an EAGLE head directory holds "
                             "config.json and model.safetensors or pytorch_model.bin)")
    with open(config_path, encoding="utf-8") as f:
        values = json.load(f)
    values["model_type"] = "llama"
    values.pop("architectures", None)
    config = transformers.LlamaConfig(**values)
    config.architectures = json.load(open(config_path, encoding="utf-8")).get("architectures") or []
    return config


def iterate_head_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the head: ``*.safetensors`` if any, else ``pytorch_model*.bin``."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise ModelLoadError(f"--speculative-draft-model-path {path}: no *.safetensors or pytorch_model*.bin")
    for file in files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def head_weight_names(path: str) -> list[str]:
    """Tensor names of the head's checkpoint, with a leading ``model.`` removed."""
    return [_strip(n) for n, _ in iterate_head_weights(path)]


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


class EagleDecoderLayer(nn.Module):
    """The head's decoder layer (EAGLE-1/2: no input norm; EAGLE-3: attention over 2H)."""

    def __init__(self, config: Any, eagle3: bool) -> None:
        super().__init__()
        self.eagle3 = eagle3
        hidden = config.hidden_size
        self.self_attn = LlamaAttention(config, 0, None, "layer.self_attn")
        if eagle3:
            attn = self.self_attn
            attn.qkv_proj = QKVParallelLinear(2 * hidden, attn.head_dim, attn.total_heads, attn.total_kv_heads,
                                              bias=False, prefix="layer.self_attn.qkv_proj")
            self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, None, "layer.mlp")

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, feature: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """The layer's output (the residual stream, before any norm)."""
        if self.eagle3:
            residual = feature
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        else:
            residual = x = feature  # EAGLE-1/2: fc's output, the first layer skips its input norm
        x = self.self_attn(positions, x, forward_batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


class EagleHead(nn.Module):
    """One EAGLE draft head; ``forward`` gives the next features and (at chosen rows) logits."""

    def __init__(self, config: Any, eagle3: bool, target_hidden: int, fc_bias: bool, own_embed: bool,
                 own_lm_head: bool) -> None:
        super().__init__()
        self.config = config
        self.eagle3 = eagle3
        hidden = config.hidden_size
        if hidden != target_hidden:
            raise ModelLoadError(f"EAGLE head hidden_size {hidden} differs from the target's {target_hidden}; "
                                 "accepted: a head trained for this target")
        self.fc = nn.Linear((3 if eagle3 else 2) * hidden, hidden, bias=fc_bias)
        self.layer = EagleDecoderLayer(config, eagle3)
        self.norm = RMSNorm(hidden, config.rms_norm_eps) if eagle3 else None
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, hidden)) if own_embed else None
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.lm_head = nn.Parameter(torch.empty(self.draft_vocab_size, hidden)) if own_lm_head else None
        # EAGLE-3: draft id -> target id offset (``target = draft + d2t[draft]``).
        self.register_buffer("d2t", None, persistent=False)

    def forward(self, input_ids: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch, embed: nn.Module) -> torch.Tensor:
        """Args: ``feature`` ``[n, H]`` (or ``[n, 3H]``: EAGLE-3 target layer outputs); ``embed``
        the target's embedding, used when the head has none. Returns ``[n, H]`` features."""
        embeds = (nn.functional.embedding(input_ids, self.embed_tokens) if self.embed_tokens is not None
                  else embed(input_ids))
        if self.eagle3:
            if feature.shape[-1] != self.config.hidden_size:
                feature = self.fc(feature)
        else:
            feature = self.fc(torch.cat([embeds, feature.to(embeds.dtype)], dim=-1))
        return self.layer(positions, embeds, feature.to(embeds.dtype), forward_batch)

    def logits(self, features: torch.Tensor, target_lm_head: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[n, V]`` logits over the head's vocabulary (the draft vocabulary for EAGLE-3 with one)."""
        h = self.norm(features) if self.norm is not None else features
        weight = self.lm_head if self.lm_head is not None else target_lm_head[:vocab_size]
        return torch.matmul(h, weight.t()).float()

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids] if self.d2t is not None else ids

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for raw, tensor in weights:
            name = _strip(raw)
            if name == "d2t":
                self.d2t = tensor.to(torch.int64).to(self.fc.weight.device)
                continue
            if name == "t2d" or "rotary_emb.inv_freq" in name:
                continue
            if name.startswith("lm_head.") and self.lm_head is None:
                continue  # EAGLE-1/2: the target's LM head is used
            if name.startswith("midlayer."):
                name = "layer." + name[len("midlayer."):]
            elif name.startswith("layers.0."):
                name = "layer." + name[len("layers.0."):]
                if not self.eagle3 and name == "layer.input_layernorm.weight":
                    continue  # EAGLE-1/2 skip the first layer's input norm
            elif name.startswith(("layers.", "midlayers.")):
                raise ModelLoadError(f"EAGLE head tensor '{raw}': only one-layer heads are supported")
            if name in ("embed_tokens.weight", "lm_head.weight"):
                name = name.split(".")[0]
            target, shard = name, None
            for stacked, ckpt, shard_id in _STACKED:
                if f".{ckpt}." in name:
                    target, shard = name.replace(f".{ckpt}.", f".{stacked}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"EAGLE head tensor '{raw}' has no matching parameter "
                                     f"({'EAGLE-3' if self.eagle3 else 'EAGLE-1/2'} layout)")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ModelLoadError(f"EAGLE head tensor '{raw}' has shape {tuple(tensor.shape)}; "
                                         f"expected {tuple(param.shape)}")
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        missing = sorted(n for n in params if n not in loaded)
        if missing:
            raise ModelLoadError(f"EAGLE head checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}")
        if self.eagle3 and self.lm_head is not None and self.draft_vocab_size != self.config.vocab_size \
                and self.d2t is None:
            raise ModelLoadError("EAGLE-3 head with a draft vocabulary of "
                                 f"{self.draft_vocab_size} tokens has no d2t tensor (draft id -> target id)")


def build_head(path: str, target_config: Any, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """Loads the head at ``path`` (either layout), on ``device`` in ``dtype``."""
    config = read_head_config(path)
    names = head_weight_names(path)
    eagle3 = any(n.startswith("midlayer.") for n in names) or any("Eagle3" in a for a in config.architectures)
    if getattr(config, "num_hidden_layers", 1) != 1 and not eagle3:
        raise ModelLoadError(f"EAGLE head {path}: num_hidden_layers {config.num_hidden_layers}; accepted: 1")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleHead(config, eagle3, target_config.hidden_size, fc_bias="fc.bias" in names,
                             own_embed="embed_tokens.weight" in names,
                             own_lm_head=eagle3 and "lm_head.weight" in names)
    finally:
        torch.set_default_dtype(previous)
    head.load_weights(iterate_head_weights(path))
    head.eval()
    return head


def aux_layer_ids(config: Any, target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's target layers (their outputs): the config's ``eagle_aux_hidden_state_layer_ids``
    (top level or under ``eagle_config``), else low/middle/high: 1, L/2 - 1, L - 4."""
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = [1, target_layers // 2 - 1, target_layers - 4]
        ids = [min(max(i, 0), target_layers - 1) for i in ids]
    ids = tuple(int(i) for i in ids)
    bad = [i for i in ids if not 0 <= i < target_layers]
    if bad or len(ids) != 3:
        raise ModelLoadError(f"EAGLE-3 eagle_aux_hidden_state_layer_ids {list(ids)}; accepted: three layer ids "
                             f"of the target, 0..{target_layers - 1}")
    return ids
