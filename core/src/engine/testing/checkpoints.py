"""Tiny random Hugging Face checkpoints built locally (no downloads) for tests."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

# The test checkpoints' byte-level BPE (2,048 tokens, ChatML template); scripts/build_tiny_tokenizer.py.
_TOKENIZER_DIR = os.path.join(os.path.dirname(__file__), "tiny_tokenizer")

# Small but real shapes: GQA (4 query heads over 2 KV heads), several layers.
_BASE = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=3, tie_word_embeddings=False)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

#: A dense and an MoE model (architecture, ``tiny_config`` overrides) wide enough for the GPU decode
#: kernels' real tile shapes (hidden 256; the MoE with 128-wide heads, 8 experts, top 2): the models
#: GPU tests switch a platform kernel option on and off in (``cuda.pdl``, ``cuda.norm_fusion``).
DECODE_KERNEL_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=512)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=128, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=True)),
}


def reference_model_class(reference: str | type) -> type:
    """A transformers model class, given itself or its name in ``transformers``."""
    import transformers

    if isinstance(reference, type):
        return reference
    cls = getattr(transformers, reference, None)
    if not isinstance(cls, type):
        raise ValueError(f"'{reference}' is not a transformers model class; give the class your model reproduces "
                         "(e.g. reference_model='LlamaForCausalLM') and, for a new architecture name, its own "
                         "`architecture`")
    return cls


def tiny_config(architecture: str, config_class: type | str | None = None, reference: str | type | None = None,
                **overrides: Any) -> Any:
    """A transformers config with tiny shapes whose ``architectures`` is ``[architecture]``.

    Args:
        architecture: written into ``architectures``: the name the engine looks its model plugin up by.
        config_class: a transformers config class, or a registered ``model_type`` (``"llama"``); default:
            the ``config_class`` of ``reference``.
        reference: the transformers model class (or its name) the checkpoint is built with; default
            ``architecture``.
        overrides: config values over the tiny defaults.
    """
    import transformers

    ref_name = reference if isinstance(reference, str) else getattr(reference, "__name__", architecture)
    values = dict(_BASE)
    if ref_name == "MistralForCausalLM":
        values["sliding_window"] = 24  # short, so the tests exercise the window
    if ref_name == "Qwen3ForCausalLM":
        values["head_dim"] = 32  # Qwen3 decouples head_dim from hidden_size / heads
    if ref_name == "Qwen2ForCausalLM":
        values["tie_word_embeddings"] = True
    values.update(overrides)
    if isinstance(config_class, str):
        config = transformers.AutoConfig.for_model(config_class, **values)
    else:
        cls = config_class or reference_model_class(reference or architecture).config_class
        config = cls(**values)
    config.architectures = [architecture]
    return config


def copy_tokenizer(directory: str) -> None:
    """Copies the tiny byte-level BPE tokenizer (2048 tokens) the test checkpoints share."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(_TOKENIZER_DIR, name), os.path.join(directory, name))


def make_tiny_checkpoint(directory: str, architecture: str = "LlamaForCausalLM", seed: int = 0,
                         dtype: str = "float32", *, reference: str | type | None = None,
                         config_class: type | str | None = None, **overrides: Any) -> str:
    """Writes config.json, tokenizer files and model.safetensors of a random tiny model.

    The weights come from the transformers class ``reference`` (default: ``architecture``, which
    must then be a transformers class); config.json names ``architecture``, so a new architecture
    name is served by the plugin that registers it while transformers stays the oracle.
    """
    import torch

    os.makedirs(directory, exist_ok=True)
    config = tiny_config(architecture, config_class, reference, **overrides)
    torch.manual_seed(seed)
    model = reference_model_class(reference or architecture)(config)
    # Random init has tiny logits; scale the output so greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)
    # save_pretrained writes the saving class's name into `architectures`; the engine must see
    # `architecture`, or a reference model would pick the built-in plugin instead of the one tested.
    config_path = os.path.join(directory, "config.json")
    with open(config_path, encoding="utf-8") as f:
        saved = json.load(f)
    saved["architectures"] = [architecture]
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=2)
    copy_tokenizer(directory)
    return directory


def load_hf_model(directory: str, dtype: str = "float32", device: str = "cpu",
                  reference: str | type | None = None) -> Any:
    """The transformers model of a checkpoint: ``reference`` (a class or its name) when given, else
    whatever ``AutoModelForCausalLM`` picks from the config's ``model_type``."""
    import torch
    import transformers

    cls = reference_model_class(reference) if reference is not None else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(directory, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def hf_from_gguf(gguf_path: str, **kwargs: Any) -> Any:
    """transformers' ``AutoModelForCausalLM`` loaded from a GGUF file (``gguf_file=``), the oracle
    of the GGUF parity tests, with the file's metadata parsed once rather than once per loader
    (config and weights each parse it; seconds each on a real vocabulary)."""
    import transformers

    from engine.model_executor.gguf_convert import one_gguf_parse

    with one_gguf_parse(gguf_path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path), **kwargs).eval()


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
