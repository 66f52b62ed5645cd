"""Tiny EAGLE heads in the published layouts, for tests (random weights, or a copy of a
one-layer target that drafts exactly the target's greedy tokens)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def make_eagle_head(directory: str, target_dir: str, kind: str = "eagle", seed: int = 0, layout: str = "safetensors",
                    aux_layer_ids: list[int] | None = None, draft_vocab_size: int | None = None) -> str:
    """Writes config.json and the weights of a random EAGLE-1/2 (``kind="eagle"``) or EAGLE-3
    (``"eagle3"``) head for the target at ``target_dir`` (``layout``: "safetensors" or "bin")."""
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    d = h // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (3.0 / shape[-1] ** 0.5)

    prefix = "midlayer." if kind == "eagle3" else "layers.0."
    w = {f"{prefix}self_attn.q_proj.weight": rand(heads * d, 2 * h if kind == "eagle3" else h),
         f"{prefix}self_attn.k_proj.weight": rand(kv_heads * d, 2 * h if kind == "eagle3" else h),
         f"{prefix}self_attn.v_proj.weight": rand(kv_heads * d, 2 * h if kind == "eagle3" else h),
         f"{prefix}self_attn.o_proj.weight": rand(h, heads * d),
         f"{prefix}mlp.gate_proj.weight": rand(inter, h), f"{prefix}mlp.up_proj.weight": rand(inter, h),
         f"{prefix}mlp.down_proj.weight": rand(h, inter),
         f"{prefix}post_attention_layernorm.weight": torch.ones(h)}
    config = dict(config, num_hidden_layers=1)
    if kind == "eagle3":
        vocab = draft_vocab_size or config["vocab_size"]
        w.update({"fc.weight": rand(h, 3 * h), f"{prefix}input_layernorm.weight": torch.ones(h),
                  f"{prefix}hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h),
                  "lm_head.weight": rand(vocab, h)})
        # Draft vocabulary: every other target id (d2t holds target - draft).
        ids = torch.arange(vocab) * (config["vocab_size"] // vocab)
        w["d2t"] = ids - torch.arange(vocab)
        w["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool).index_fill_(0, ids, True)
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=vocab)
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    else:
        w.update({"fc.weight": rand(h, 2 * h), "fc.bias": torch.zeros(h)})
        config.update(architectures=["LlamaForCausalLM"])
    return _save(directory, config, w, layout)


def make_copying_eagle_head(directory: str, target_dir: str, layout: str = "safetensors") -> str:
    """An EAGLE-1 head that reproduces a one-layer target built by ``make_bigram_target``: fc
    passes the token embedding through, the layer is the target's layer (its attention output
    is zero), so draft ``j`` is the target's greedy token: every draft is accepted."""
    from safetensors.torch import load_file

    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    t = load_file(os.path.join(target_dir, "model.safetensors"))
    h = config["hidden_size"]
    w = {k.replace("model.layers.0.", "layers.0."): v for k, v in t.items()
         if k.startswith("model.layers.0.") and "input_layernorm" not in k}
    w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    w["fc.bias"] = torch.zeros(h)
    w["embed_tokens.weight"] = t["model.embed_tokens.weight"]
    return _save(directory, dict(config, num_hidden_layers=1, architectures=["LlamaForCausalLM"]), w, layout)


def make_bigram_target(directory: str, lm_head_scale: float = 1.0) -> str:
    """A one-layer tiny Llama whose next token depends on the current token only (attention
    output zero), with unit-RMS embeddings and unit norm weights, so an EAGLE-1 head can copy it.
    ``lm_head_scale`` multiplies the LM head (same greedy tokens; above 1 the next-token
    distribution is peaked, as a trained model's mostly is, so trees grow along the best path)."""
    from safetensors.torch import load_file, save_file

    from engine.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(directory, "LlamaForCausalLM", num_hidden_layers=1)
    path = os.path.join(directory, "model.safetensors")
    t = load_file(path)
    t["model.layers.0.self_attn.o_proj.weight"].zero_()
    e = t["model.embed_tokens.weight"]
    t["model.embed_tokens.weight"] = e / e.pow(2).mean(-1, keepdim=True).sqrt()
    for name in ("model.layers.0.input_layernorm.weight", "model.norm.weight"):
        t[name] = torch.ones_like(t[name])
    t["lm_head.weight"] = t["lm_head.weight"] * lm_head_scale
    save_file(t, path, metadata={"format": "pt"})
    return directory


def _save(directory: str, config: dict[str, Any], weights: dict[str, torch.Tensor], layout: str) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    weights = {k: v.contiguous() for k, v in weights.items()}
    if layout == "bin":
        torch.save(weights, os.path.join(directory, "pytorch_model.bin"))
    else:
        from safetensors.torch import save_file

        save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory
