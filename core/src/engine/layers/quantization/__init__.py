"""The quantization-method contract (what quant plugins implement).

A quant plugin's factory returns a ``QuantizationConfig``. For each linear layer not
listed by ``ignored_layers()`` the layer asks ``quant_config.get_linear_method(layer, prefix)`` for a
``LinearMethodBase`` that creates the layer's parameters, post-processes them
after loading, and computes the layer's output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn


@dataclass(frozen=True)
class QuantizedActivation:
    """Activations quantized by the layer that produced them (RMSNorm, SiLU-and-mul), handed to
    the next linear layer instead of a 16-bit tensor, so quantizing them costs no launch of its own.

    Only a linear whose method's ``activation_quantizer`` made them ever receives one.
    """

    #: ``[tokens, features]`` codes (e.g. float8_e4m3fn, int8).
    q: torch.Tensor
    #: ``[tokens, 1]`` float32: the multiplier that dequantizes each token's row.
    scale: torch.Tensor
    #: the activation dtype the unfused layer would have produced; the linear outputs it.
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


class ActivationQuantizer(ABC):
    """Fused producer-side activation quantization a linear method offers (its
    ``activation_quantizer``). A model declares which layer feeds which linear
    (``activation_consumers`` on a module: ``{"input_layernorm": "self_attn.qkv_proj", ...}``);
    at start-up ``engine.layers.quantization.fusion.link_activation_quantizers`` hands each
    producer its consumer's quantizer, and from then on the producer calls it for the token
    counts where ``wants`` says the consumer multiplies quantized activations.

    The fused ops must give the codes and scales the consumer would compute itself from the
    unfused producer's output.
    """

    @abstractmethod
    def wants(self, x: torch.Tensor) -> bool:
        """Whether the consumer takes quantized activations for input ``x`` (its device and
        token count); False: the producer runs unfused and returns a tensor."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
                 ) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
        """``RMSNorm`` (with ``residual``: added first and also returned, as ``RMSNorm.forward``)
        whose output comes quantized."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse into RMSNorm")

    def silu_and_mul(self, x: torch.Tensor) -> QuantizedActivation:
        """``silu(x[:, :d]) * x[:, d:]`` quantized."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse into SiLU-and-mul")


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

    def activation_quantizer(self, layer: nn.Module) -> ActivationQuantizer | None:
        """The fused quantization this layer's producer may run instead of handing it 16-bit
        activations (see ``ActivationQuantizer``); then ``apply`` also receives
        ``QuantizedActivation`` inputs. Default None: always a tensor."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` with the layer's (possibly quantized) weight; ``x`` is a
        ``QuantizedActivation`` only where ``activation_quantizer`` offered one."""


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
        """Runs the routed experts for each token and sums them by ``topk_weights``.

        ``topk_ids`` are this rank's expert indices (``[tokens, top_k]`` int32); ``-1`` marks an
        expert another expert-parallel rank holds, which contributes nothing here. The layer
        (``engine.layers.moe.FusedMoE``) all-reduces the result over the tensor-parallel group."""


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

    def get_lm_head_projection(self, lm_head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A faster ``h @ lm_head.weight.T`` for the loaded LM head (``ParallelLMHead``), or None
        (the default) to keep ``F.linear``. Called once after loading; the callable takes the
        hidden states ``[rows, hidden]`` and returns this rank's logits ``[rows, vocab rows]``,
        equal to the float product up to the order of float sums."""
        return None

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
