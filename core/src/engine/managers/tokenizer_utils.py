"""Loading tokenizers (transformers) with clear errors."""

from __future__ import annotations

import os
from typing import Any

from engine.errors import ModelLoadError


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ModelLoadError(f"--tokenizer-path: not a directory: {path}")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {path}: {exc} (use --skip-tokenizer-init to run on token ids)"
        ) from None
