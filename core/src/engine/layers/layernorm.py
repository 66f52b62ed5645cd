"""RMSNorm with an optional fused residual add, and its fusion into the linear layer after it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.layers.quantization import ActivationQuantizer


@dataclass(frozen=True)
class PendingNorm:
    """An RMSNorm not yet computed: its inputs, handed to the linear layer that reads its output
    first (``RMSNorm.fuse_into``), whose kernel normalizes the rows itself as it multiplies them,
    so the norm costs no launch of its own.

    What a consumer must do: compute ``weight * norm(x + residual)`` exactly as ``RMSNorm`` does
    (the sum rounded to the activation dtype, float32 mean of squares, ``rsqrt(var + eps)``, the
    normalized value rounded, the product with ``weight`` rounded), use it as its input, and write
    it into ``normed`` and ``x + residual`` into ``res_sum`` (with a residual) before anything
    after it runs: both are handed out already (``res_sum`` as the decoder's new residual,
    ``normed`` through ``normed_tensor``) and hold garbage until then. Only a linear layer whose
    ``takes_pending_norm`` said yes for ``x`` ever receives one.
    """

    #: ``[tokens, hidden]`` the norm's input (before the residual add).
    x: torch.Tensor
    #: ``[tokens, hidden]`` added to ``x`` first; None: no residual.
    residual: torch.Tensor | None
    #: ``[hidden]`` the norm's weight.
    weight: torch.Tensor
    #: the norm's epsilon.
    eps: float
    #: preallocated for the norm output, in the input's shape (readers after the consumer).
    normed: torch.Tensor
    #: preallocated for ``x + residual`` (the next residual); ``x`` itself when there is no residual.
    res_sum: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.normed.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.normed.dtype


def normed_tensor(x: torch.Tensor | PendingNorm) -> torch.Tensor:
    """The norm output as a tensor, for a reader after the consumer of a ``PendingNorm`` (the MoE
    experts after the router): its ``normed`` (filled once the consumer ran); a tensor passes through."""
    return x.normed if isinstance(x, PendingNorm) else x


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in float32 and cast back like Hugging Face's.

    ``forward(x, residual)`` first adds ``residual`` to ``x`` and returns
    ``(normed, x + residual)`` so decoder layers need one call per norm.
    Platforms may provide a fused kernel (``Platform.layer_kernels()['rms_norm']``); a quantized
    consumer may have the output come quantized (``out_quant``, see ``quantization.fusion``); an
    unquantized one may compute the norm itself (``fuse_into``: the output is a ``PendingNorm``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps
        self.fused: Callable[..., Any] | None = None
        #: the consumer's ``ActivationQuantizer`` (``quantization.fusion``); None: plain output.
        self.out_quant: ActivationQuantizer | None = None
        #: the linear layer that reads the output first and can compute the norm itself (linked at
        #: start-up by ``quantization.fusion.link_norm_consumers``); None: the norm runs here.
        self.fuse_into: Any = None

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's fused ``rms_norm`` when it offers one."""
        self.fused = kernels.get("rms_norm")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.out_quant is not None and self.out_quant.wants(x):
            return self.out_quant.rms_norm(x, self.weight, self.variance_epsilon, residual)
        if self.fuse_into is not None:
            pending = self._pending(x, residual)
            if pending is not None:
                # Typed as a tensor for the decoder layers: only fuse_into reads it as such.
                return pending if residual is None else (pending, pending.res_sum)  # type: ignore[return-value]
        if self.fused is not None and x.is_cuda:
            return self.fused(x, self.weight, self.variance_epsilon, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _pending(self, x: torch.Tensor, residual: torch.Tensor | None) -> PendingNorm | None:
        """The norm handed on to ``fuse_into`` when its kernel takes ``x``; None: computed here."""
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                     or residual.stride(-1) != 1):
            return None
        x2 = x.reshape(-1, x.shape[-1])
        if not self.fuse_into.takes_pending_norm(x2):
            return None
        normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if residual is None:
            return PendingNorm(x2, None, self.weight, self.variance_epsilon, normed, x)
        res_sum = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return PendingNorm(x2, residual.reshape(-1, x.shape[-1]), self.weight, self.variance_epsilon, normed, res_sum)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu":
            # One call instead of seven; on the CPU in float32 its result is bit-identical to the
            # composite below (checked over hidden sizes 64-4096), and per-call overhead is what a
            # CPU decode step spends most on outside the weight products.
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)
