"""Gated activations: ``act(x[..., :d]) * x[..., d:]`` on a gate+up projection of width ``2d``.

One class per activation, so the name says what runs: ``SiluAndMul`` (Llama, Mistral, Qwen)
and ``GeluAndMul`` (Gemma-style GELU gates). ``get_act_and_mul(config.hidden_act)`` picks the
class for a Hugging Face ``hidden_act`` value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.quantization import ActivationQuantizer


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]``; on CUDA the platform's fused ``silu_and_mul`` kernel, or
    the consumer's quantizing one (``out_quant``, see ``quantization.fusion``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused: Callable[..., Any] | None = None
        self.out_quant: ActivationQuantizer | None = None

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's fused ``silu_and_mul`` when it offers one."""
        self.fused = kernels.get("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.out_quant is not None and self.out_quant.wants(x):
            return self.out_quant.silu_and_mul(x)  # type: ignore[return-value]
        if self.fused is not None and x.is_cuda:
            return self.fused(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """``gelu(x[..., :d]) * x[..., d:]``, exact (``approximate="none"``) or tanh-approximated.

    PyTorch code on every platform: no platform offers a fused GELU kernel yet.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GeluAndMul: invalid approximate '{approximate}'; accepted: none, tanh")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


# Hugging Face ``hidden_act`` values -> the gated module computing them.
_GATED: dict[str, Callable[[], nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,  # transformers' alias of silu
    "gelu": lambda: GeluAndMul("none"),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_new": lambda: GeluAndMul("tanh"),  # the tanh approximation under its GPT-2 name
}


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation module for a Hugging Face ``hidden_act`` value.

    Raises:
        ValueError: ``hidden_act`` is not one of the supported names (listed in the message).
    """
    make = _GATED.get(hidden_act)
    if make is None:
        raise ValueError(f"unsupported hidden_act '{hidden_act}'; supported: {', '.join(_GATED)}")
    return make()
