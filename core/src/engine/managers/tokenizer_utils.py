"""Loading tokenizers (transformers) with clear errors."""

from __future__ import annotations

import os
import threading
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


_shared: dict[tuple[str, bool], Any] = {}
_shared_lock = threading.Lock()


def shared_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer at ``path``, loaded once per process: the scheduler's grammar backend and its
    stop-string checks decode with the same one (a load takes seconds of CPU). Read-only use:
    callers must not change its settings. A caller arriving during the load waits for it."""
    key = (path, trust_remote_code)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = load_tokenizer(path, trust_remote_code)
        return _shared[key]
