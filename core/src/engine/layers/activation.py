"""Gated activations: ``act(x[..., :d]) * x[..., d:]`` on a gate+up projection of width ``2d``.

One class per activation, so the name says what runs: ``SiluAndMul`` (Llama, Mistral, Qwen)
and ``GeluAndMul`` (Gemma-style GELU gates). ``get_act_and_mul(config.hidden_act)`` picks the
class for a Hugging Face ``hidden_act`` value.

``SiluAndMul(act)``, the form that took the activation's name, is deprecated (docs/stability.md):
it still builds what ``get_act_and_mul(act)`` builds, with a ``DeprecationWarning``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.deprecation import warn_deprecated
from engine.layers.quantization import ActivationQuantizer


# Hugging Face ``hidden_act`` names of SiLU.
_SILU_NAMES = ("silu", "swish")


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]``; on CUDA the platform's fused ``silu_and_mul`` kernel, or
    the consumer's quantizing one (``out_quant``, see ``quantization.fusion``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # The deprecated SiluAndMul(act): the instance get_act_and_mul(act) gives, so a GELU name
        # yields a GeluAndMul (never a SiluAndMul computing GELU, which the SiLU-only fused and
        # quantizing kernels would take for SiLU); Python then skips __init__ for it. Subclasses
        # keep their own constructor arguments.
        if cls is SiluAndMul and (args or kwargs):
            act = args[0] if args else kwargs.get("act")
            warn_deprecated("SiluAndMul(act)")
            if act not in _SILU_NAMES:
                return get_act_and_mul(act)
        return super().__new__(cls)

    def __init__(self, act: str | None = None) -> None:
        super().__init__()
        if act is not None and type(self) is not SiluAndMul:
            # A subclass passing the old argument on: it can only ever have meant SiLU here.
            warn_deprecated("SiluAndMul(act)")
            if act not in _SILU_NAMES:
                raise ValueError(f"SiluAndMul: act '{act}' in a subclass of SiluAndMul; accepted: "
                                 f"{', '.join(_SILU_NAMES)} (derive from the class get_act_and_mul('{act}') "
                                 "returns instead)")
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
