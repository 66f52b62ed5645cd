"""The quantization-method contract (what quant plugins implement).

A quant plugin's factory returns a ``QuantizationConfig``. For each linear layer not
listed by ``ignored_layers()`` the layer asks ``quant_config.get_linear_method(layer, prefix)`` for a
``LinearMethodBase`` that creates the layer's parameters, post-processes them
after loading, and computes the layer's output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from torch import nn


class LinearMethodBase(ABC):
    """How one linear layer stores its weight and multiplies by it."""

    #: The layer takes a GGUF tensor as stored (``uint8`` blocks after a ``weight_type``), when the
    #: config ``loads_gguf_blocks``; False: the model loader hands it dequantized floats.
    accepts_gguf_blocks: bool = False

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

    def init_dummy_weights(self, layer: nn.Module, seed: int) -> None:
        """Fills the parameters ``--load-format dummy`` leaves alone (those not float32/16-bit:
        packed integers, blocks, fp8 codes) with valid random data, before
        ``process_weights_after_loading``; default: nothing (they stay as allocated)."""

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
    #: The method reads the weights from the GGUF file itself (the ``gguf`` plugin): the model
    #: loader streams its layers' tensors as stored, and the checkpoint must be a GGUF.
    loads_gguf_blocks: bool = False

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
        """Activation dtypes the method runs with; the engine refuses any other ``--dtype``
        before the model loads."""
        return [torch.float32, torch.bfloat16, torch.float16]

    def load_report(self) -> str | None:
        """One line the engine logs once the weights are loaded (e.g. the memory a method saved);
        None logs nothing."""
        return None

    def ignored_layers(self) -> list[str]:
        """Layers left unquantized, as the checkpoint names them (its ``quantization_config``'s
        ``ignored_layers``): full prefixes (``model.layers.0.mlp.down_proj``) or short names
        (``lm_head``). The linear layers check it before ``get_linear_method`` (see
        ``is_layer_ignored``), so a method need not; the start-up log lists them."""
        return []


#: Fused layers of the layer SDK and the checkpoint projections each one stacks (as SGLang's
#: ``packed_modules_mapping`` for the Llama family): checkpoints name the parts.
FUSED_LAYER_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def is_layer_ignored(prefix: str, ignored: list[str]) -> bool:
    """Whether the linear layer at ``prefix`` stays unquantized under ``ignored``.

    A fused layer is ignored only when every projection it stacks is; some but not all is a
    ``ModelLoadError``, since one fused weight cannot be part quantized, part not.
    """
    if not ignored:
        return False
    parent, _, leaf = prefix.rpartition(".")
    parts = [f"{parent}.{p}" if parent else p for p in FUSED_LAYER_PARTS.get(leaf, (leaf,))]
    hits = [any(_names_layer(part, pattern) for pattern in ignored) for part in parts]
    if any(hits) and not all(hits):
        raise ModelLoadError(f"ignored_layers leaves only some of {', '.join(parts)} unquantized; "
                             f"the engine fuses them into {prefix}, so ignore all or none")
    return all(hits)


def _names_layer(name: str, pattern: str) -> bool:
    # Checkpoints list full prefixes ("model.layers.0.mlp.down_proj") or short names ("lm_head").
    return name == pattern or name.endswith("." + pattern)
