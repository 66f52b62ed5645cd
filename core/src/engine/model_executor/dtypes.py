"""The activation and weight dtype a run uses: ``--dtype``, else the checkpoint's, else the platform's.

Apart from the model loader so that component selection (``engine.selection``), which the loader
takes as input, can resolve the dtype without importing the loader.
"""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, config: Any, platform_default: torch.dtype) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = _DTYPES.get(cfg)
    if isinstance(cfg, torch.dtype) and cfg in _DTYPES.values():
        # float32 checkpoints run in the platform's dtype on accelerators, as in SGLang.
        return platform_default if cfg == torch.float32 and platform_default != torch.float32 else cfg
    return platform_default
