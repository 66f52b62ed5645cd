"""``W8A8Int8Config``: on-the-fly int8 (``--quant w8a8_int8``) or an int8 checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import ModelLoadError
from engine.layers.quantization import LinearMethodBase, QuantizationConfig

if TYPE_CHECKING:
    from torch import nn

CHECKPOINT_METHODS = ("w8a8_int8",)


@dataclass
class W8A8Int8Config(QuantizationConfig):
    """int8 weights with per-output-channel scales, int8 activations with per-token scales.

    ``checkpoint_serialized`` False (``--quant w8a8_int8`` on a 16/32-bit checkpoint):
    weights load in the model dtype and are quantized after loading. True
    (``quantization_config.quant_method == "w8a8_int8"``, SGLang's layout): the
    checkpoint holds an int8 ``weight [out, in]`` and a float32 ``weight_scale [out, 1]``
    per projection. Activations are always quantized dynamically.
    """

    #: the checkpoint already stores int8 weights and per-channel scales.
    checkpoint_serialized: bool = False

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
        return cls(checkpoint_serialized=True)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        from engine_quant_int8.method import W8A8Int8LinearMethod

        return W8A8Int8LinearMethod(self)
