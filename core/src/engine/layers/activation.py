"""Gated activations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class SiluAndMul(nn.Module):
    """``act(x[..., :d]) * x[..., d:]`` for a gate+up projection of width ``2d``."""

    def __init__(self, act: str = "silu") -> None:
        super().__init__()
        if act not in _ACTS:
            raise ValueError(f"unsupported hidden_act '{act}'; supported: {', '.join(_ACTS)}")
        self.act = _ACTS[act]
        self.is_silu = act == "silu"
        self.fused: Callable[..., Any] | None = None

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's fused ``silu_and_mul`` for SiLU gates."""
        self.fused = kernels.get("silu_and_mul") if self.is_silu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.is_cuda:
            return self.fused(x)
        d = x.shape[-1] // 2
        return self.act(x[..., :d]) * x[..., d:]
