"""``Fp8Config``: on-the-fly FP8 (``--quant fp8``) or an FP8-serialized checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import ModelLoadError
from engine.layers.quantization import LinearMethodBase, QuantizationConfig

if TYPE_CHECKING:
    from torch import nn

ACTIVATION_SCHEMES = ("dynamic", "static")


@dataclass
class Fp8Config(QuantizationConfig):
    """FP8 e4m3 weights.

    ``checkpoint_serialized`` False (``--quant fp8`` on a 16/32-bit checkpoint): weights
    load in the model dtype and are quantized per output channel after loading.
    True (``quantization_config.quant_method == "fp8"``): the checkpoint holds
    float8_e4m3fn ``weight`` plus a per-tensor ``weight_scale`` per projection, and with
    ``activation_scheme: static`` an ``input_scale`` per projection.
    """

    #: the checkpoint already stores float8 weights and scales.
    checkpoint_serialized: bool = False
    #: ``dynamic``: activation scales per token at run time; ``static``: the checkpoint's input_scale.
    activation_scheme: str = "dynamic"
    #: layer prefixes the checkpoint left in 16-bit (``ignored_layers``).
    ignored: tuple[str, ...] = ()

    name = "fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        """``{}`` (on-the-fly) or a checkpoint's ``quantization_config``."""
        if not config:
            return cls()
        method = config.get("quant_method", "fp8")
        if method != "fp8":
            raise ModelLoadError(f"plugserve-quant-fp8: quantization_config.quant_method is '{method}'; accepted: fp8")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ModelLoadError(f"fp8 quantization_config.activation_scheme: invalid value '{scheme}'; "
                                 f"accepted: {', '.join(ACTIVATION_SCHEMES)}")
        if config.get("weight_block_size"):
            raise ModelLoadError(f"fp8 quantization_config.weight_block_size {config['weight_block_size']}: "
                                 "block-wise FP8 checkpoints are not supported by plugserve-quant-fp8 "
                                 "(per-tensor weight_scale only)")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
        return cls(checkpoint_serialized=True, activation_scheme=scheme, ignored=tuple(ignored))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        # Layers in ignored_layers() never get here: the layer SDK leaves them unquantized.
        from engine_quant_fp8.method import Fp8LinearMethod

        return Fp8LinearMethod(self)

    def ignored_layers(self) -> list[str]:
        return list(self.ignored)
