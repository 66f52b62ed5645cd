"""Gated activations."""

from __future__ import annotations

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return self.act(x[..., :d]) * x[..., d:]
