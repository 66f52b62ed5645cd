"""Which checkpoint directory to load, and its config: nothing here imports torch.

The main process resolves the checkpoint (the default model, a GGUF converted once, or the given
directory) before it starts the engine's processes, so keeping torch out of this path keeps that
serial part of start-up short.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from engine.errors import ModelLoadError


def resolve_checkpoint(model_path: str | None, disabled: Iterable[str] = (), weights: bool = True) -> str:
    """The Hugging Face directory the engine loads for ``--model-path``.

    None means the embedded default model (SmolLM2-135M-Instruct's GGUF); a GGUF file, or a
    directory holding one GGUF and no config.json, is converted once into the cache
    (``gguf_loader``); anything else is returned as given for ``load_hf_config`` to check.
    ``weights=False``: the caller reads the weights from the GGUF itself (``--quant gguf``), so a
    GGUF's conversion may hold config and tokenizer only.
    """
    import engine.plugins as plugins
    from engine.model_executor.gguf_loader import find_gguf, prepare_gguf_checkpoint

    if model_path is None:
        from engine.default_model import default_model_gguf

        gguf_path: str | None = default_model_gguf()
    else:
        gguf_path = find_gguf(model_path)
    if gguf_path is None:
        return model_path  # type: ignore[return-value]  # not None here: None took the branch above
    blocked = tuple(disabled)
    return prepare_gguf_checkpoint(gguf_path, lambda arch: plugins.get_model_spec(arch, blocked), weights)


def load_hf_config(model_path: str, trust_remote_code: bool = False) -> Any:
    """Reads config.json with transformers; every problem becomes a ModelLoadError."""
    from transformers import AutoConfig

    if not os.path.isdir(model_path):
        raise ModelLoadError(f"--model-path: not a directory: {model_path}")
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ModelLoadError(f"--model-path: {model_path} has no config.json (expected a Hugging Face model directory)")
    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"--model-path: cannot read {model_path}/config.json: {exc}") from None
    if not getattr(config, "architectures", None):
        raise ModelLoadError(f"{model_path}/config.json names no 'architectures'; cannot pick a model plugin")
    _lift_text_config(config)
    return config


# What the engine reads from a config (pool sizing, parallelism checks, sampling) about the decoder.
_DECODER_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "max_position_embeddings", "intermediate_size", "rms_norm_eps", "sliding_window",
                 "eos_token_id")


def _lift_text_config(config: Any) -> None:
    """A vision-language config nests its decoder's shapes in ``text_config``: they are copied to
    the top level where it has none, so the engine sizes pools and checks parallelism by them."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else None
    if text is None or text is config:
        return
    for key in _DECODER_KEYS:
        if getattr(config, key, None) is None and getattr(text, key, None) is not None:
            setattr(config, key, getattr(text, key))
