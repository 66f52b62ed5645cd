"""``W8A8Int8Config``: on-the-fly int8 (``--quant w8a8_int8``) or an int8 checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import ModelLoadError
from engine.layers.quantization import LinearMethodBase, QuantizationConfig

if TYPE_CHECKING:
    from torch import nn

CHECKPOINT_METHODS = ("w8a8_int8",)
ACTIVATION_SCHEMES = ("dynamic", "static")


@dataclass
class W8A8Int8Config(QuantizationConfig):
    """int8 weights with per-output-channel scales, int8 activations with per-token scales.

    ``checkpoint_serialized`` False (``--quant w8a8_int8`` on a 16/32-bit checkpoint):
    weights load in the model dtype and are quantized after loading. True
    (``quantization_config.quant_method == "w8a8_int8"``, SGLang's layout): the
    checkpoint holds an int8 ``weight [out, in]`` and a float32 ``weight_scale [out, 1]``
    per projection; with ``activation_scheme: static`` also a float32 ``input_scale`` (one
    element) per projection, the per-tensor activation scale of the W8A8 path.
    """

    #: the checkpoint already stores int8 weights and per-channel scales.
    checkpoint_serialized: bool = False
    #: ``dynamic``: activation scales per token at run time; ``static``: the checkpoint's input_scale.
    activation_scheme: str = "dynamic"

    name = "w8a8_int8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> W8A8Int8Config:
        """``{}`` (on-the-fly) or a checkpoint's ``quantization_config``."""
        if not config:
            return cls()
        method = config.get("quant_method", "w8a8_int8")
        if method not in CHECKPOINT_METHODS:
            raise ModelLoadError(f"plugserve-quant-int8: quantization_config.quant_method is '{method}'; "
                                 f"accepted: {', '.join(CHECKPOINT_METHODS)}")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ModelLoadError(f"w8a8_int8 quantization_config.activation_scheme: invalid value '{scheme}'; "
                                 f"accepted: {', '.join(ACTIVATION_SCHEMES)}")
        return cls(checkpoint_serialized=True, activation_scheme=scheme)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        from engine_quant_int8.method import W8A8Int8LinearMethod

        return W8A8Int8LinearMethod(self)
