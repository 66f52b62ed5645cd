"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.layers.quantization import ActivationQuantizer


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in float32 and cast back like Hugging Face's.

    ``forward(x, residual)`` first adds ``residual`` to ``x`` and returns
    ``(normed, x + residual)`` so decoder layers need one call per norm.
    Platforms may provide a fused kernel (``Platform.layer_kernels()['rms_norm']``); a quantized
    consumer may have the output come quantized (``out_quant``, see ``quantization.fusion``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps
        self.fused: Callable[..., Any] | None = None
        #: the consumer's ``ActivationQuantizer`` (``quantization.fusion``); None: plain output.
        self.out_quant: ActivationQuantizer | None = None

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's fused ``rms_norm`` when it offers one."""
        self.fused = kernels.get("rms_norm")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.out_quant is not None and self.out_quant.wants(x):
            return self.out_quant.rms_norm(x, self.weight, self.variance_epsilon, residual)
        if self.fused is not None and x.is_cuda:
            return self.fused(x, self.weight, self.variance_epsilon, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)
