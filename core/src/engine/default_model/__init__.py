"""The embedded default model: a tiny Llama that needs no download.

Its config and tokenizer are committed here; its weights are random (seed 0)
and written once to a cache directory (``$ENGINE_CACHE_DIR`` or
``~/.cache/engine``) as a normal safetensors checkpoint, so the real loading
path runs. It produces fluent-looking nonsense: it exists so a fresh machine
can start the engine and see tokens flow. Point ``--model-path`` at a real model
for real text.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

_HERE = os.path.dirname(__file__)
_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def _fingerprint() -> str:
    h = hashlib.sha256()
    for name in _FILES:
        with open(os.path.join(_HERE, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def ensure_default_model() -> str:
    """Returns the directory of the default model, building it on first use."""
    root = os.environ.get("ENGINE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "engine")
    target = os.path.join(root, f"default-model-{_fingerprint()}")
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="default-model-", dir=root)
    try:
        _build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _build(directory: str) -> None:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    for name in _FILES:
        shutil.copy(os.path.join(_HERE, name), os.path.join(directory, name))
    config = AutoConfig.from_pretrained(directory)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    # save_pretrained rewrites config.json; keep the committed one byte for byte.
    shutil.copy(os.path.join(_HERE, "config.json"), os.path.join(directory, "config.json"))
