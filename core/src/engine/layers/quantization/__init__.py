"""The quantization-method contract (what quant plugins implement).

A quant plugin's factory returns a ``QuantizationConfig``. For each linear layer
the layer asks ``quant_config.get_linear_method(layer, prefix)`` for a
``LinearMethodBase`` that creates the layer's parameters, post-processes them
after loading, and computes the layer's output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn


class LinearMethodBase(ABC):
    """How one linear layer stores its weight and multiplies by it."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        weight_loader: Any,
    ) -> None:
        """Registers the layer's parameters.

        Each parameter gets ``weight_loader`` plus the attributes the loader reads:
        ``output_dim`` / ``input_dim`` (which tensor dim runs along the layer's
        output / input; absent for per-tensor scalars), and for packed formats
        ``packed_dim`` and ``packed_factor`` (elements per stored value).
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repacks or quantizes loaded weights (e.g. dynamic FP8); default: nothing."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` with the layer's (possibly quantized) weight."""


class FusedMoEMethodBase(ABC):
    """How a fused mixture-of-experts layer stores and applies its experts (MoE plugins)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        """Registers expert weights ``w13`` (gate+up) and ``w2`` (down)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repacks or quantizes loaded expert weights; default: nothing."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """Runs the routed experts for each token and sums them by ``topk_weights``."""


class QuantizationConfig(ABC):
    """A quantization method's configuration, built from a checkpoint or ``--quant``."""

    #: plugin name, as in ``--quant``.
    name: str = ""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Builds from a checkpoint's ``quantization_config`` (``{}`` for on-the-fly methods)."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for the linear layer at ``prefix``; None keeps it unquantized."""

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase | None:
        """The method for a fused MoE layer; None keeps it unquantized."""
        return None

    def supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def ignored_layers(self) -> list[str]:
        """Prefixes left unquantized (e.g. ``lm_head``)."""
        return []
