"""Tiny random Hugging Face checkpoints built locally (no downloads) for tests."""

from __future__ import annotations

import os
import shutil
from typing import Any

_DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "default_model")

# Small but real shapes: GQA (4 query heads over 2 KV heads), several layers.
_BASE = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=3, tie_word_embeddings=False)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def tiny_config(architecture: str, **overrides: Any) -> Any:
    """A transformers config of ``architecture`` with tiny shapes."""
    import transformers

    values = dict(_BASE)
    if architecture == "MistralForCausalLM":
        values["sliding_window"] = 24  # short, so the tests exercise the window
    if architecture == "Qwen3ForCausalLM":
        values["head_dim"] = 32  # Qwen3 decouples head_dim from hidden_size / heads
    if architecture == "Qwen2ForCausalLM":
        values["tie_word_embeddings"] = True
    values.update(overrides)
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_cls(**values)
    config.architectures = [architecture]
    return config


def copy_tokenizer(directory: str) -> None:
    """Copies the embedded default model's byte-level BPE tokenizer (2048 tokens)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(_DEFAULT_MODEL_DIR, name), os.path.join(directory, name))


def make_tiny_checkpoint(directory: str, architecture: str = "LlamaForCausalLM", seed: int = 0,
                         dtype: str = "float32", **overrides: Any) -> str:
    """Writes config.json, tokenizer files and model.safetensors of a random tiny model."""
    import torch
    import transformers

    os.makedirs(directory, exist_ok=True)
    config = tiny_config(architecture, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    # Random init has tiny logits; scale the output so greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)
    copy_tokenizer(directory)
    return directory


def load_hf_model(directory: str, dtype: str = "float32", device: str = "cpu") -> Any:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face ``generate(do_sample=False)`` output ids (without the prompt)."""
    import torch

    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                             attention_mask=torch.ones_like(ids))
    return out[0, len(prompt_ids):].tolist()


def hf_last_logits(model: Any, prompt_ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt_ids], device=model.device)).logits[0, -1].float().cpu()
