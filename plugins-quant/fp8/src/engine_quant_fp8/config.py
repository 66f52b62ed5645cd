"""``Fp8Config``: on-the-fly FP8 (``--quant fp8``) or an FP8-serialized checkpoint.

Two ways to build one:

- ``Fp8Config.from_config(quantization_config)`` for Hugging Face ``quant_method: "fp8"``
  checkpoints (AutoFP8 per-tensor, or DeepSeek-V3-style ``weight_block_size``), and ``{}`` for
  ``--quant fp8``;
- the dataclass directly, for other front ends of the same storage (the compressed-tensors
  plugin's float-quantized checkpoints)::

      Fp8Config(checkpoint_serialized=True, activation_scheme="dynamic", weight_strategy="channel")
      Fp8Config(checkpoint_serialized=True, weight_strategy="block", weight_block_size=(128, 128),
                block_scale_name="weight_scale")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import ModelLoadError
from engine.layers.quantization import FusedMoEMethodBase, LinearMethodBase, QuantizationConfig

from engine_quant_fp8 import FAST_ACCUM, FUSE_ACTIVATION_QUANT

if TYPE_CHECKING:
    from torch import nn

ACTIVATION_SCHEMES = ("dynamic", "static")
#: How a serialized checkpoint scales each projection's weight.
WEIGHT_STRATEGIES = ("tensor", "channel", "block")


@dataclass
class Fp8Config(QuantizationConfig):
    """FP8 e4m3 weights.

    ``checkpoint_serialized`` False (``--quant fp8`` on a 16/32-bit checkpoint): weights
    load in the model dtype and are quantized per output channel after loading.
    True: the checkpoint holds float8_e4m3fn ``weight`` per projection and, by
    ``weight_strategy``:

    - ``tensor``: a per-tensor ``weight_scale`` (``[]`` or ``[1]``), AutoFP8's layout;
    - ``channel``: ``weight_scale`` of shape ``[out, 1]`` or ``[out]``;
    - ``block``: a ``[ceil(out/bn), ceil(in/bk)]`` float32 multiplier per
      ``weight_block_size = (bn, bk)`` tile, named ``block_scale_name``.

    With ``activation_scheme: static`` (tensor and channel only) there is also an
    ``input_scale`` per projection.
    """

    #: the checkpoint already stores float8 weights and scales.
    checkpoint_serialized: bool = False
    #: ``dynamic``: activation scales per token at run time; ``static``: the checkpoint's input_scale.
    activation_scheme: str = "dynamic"
    #: layer prefixes the checkpoint left in 16-bit (``ignored_layers``).
    ignored: tuple[str, ...] = ()
    #: ``tensor``, ``channel`` or ``block`` (see the class docstring); serialized checkpoints only.
    weight_strategy: str = "tensor"
    #: ``(rows, cols)`` of one weight tile sharing a scale; set exactly when ``weight_strategy == "block"``.
    weight_block_size: tuple[int, int] | None = None
    #: the checkpoint's name of the block-scale tensor: HF fp8 ``weight_scale_inv``,
    #: compressed-tensors ``weight_scale``. Either way it is the multiplier that dequantizes.
    block_scale_name: str = "weight_scale_inv"
    #: per-channel weights with dynamic activations: RMSNorm and SiLU-and-mul quantize the
    #: activations of the linears they feed (``engine_quant_fp8.fused``) instead of a separate
    #: launch per linear (plugin option ``fp8.fuse_activation_quant``).
    fuse_activation_quant: bool = FUSE_ACTIVATION_QUANT
    #: ``torch._scaled_mm``'s ``use_fast_accum`` for the fp8 x fp8 GEMMs above
    #: ``gemm.W8A8_TRITON_MAX_M`` tokens (plugin option ``fp8.fast_accum``).
    fast_accum: bool = FAST_ACCUM

    name = "fp8"

    def __post_init__(self) -> None:
        self.ignored = tuple(self.ignored)
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ModelLoadError(f"fp8 activation_scheme: invalid value '{self.activation_scheme}'; "
                                 f"accepted: {', '.join(ACTIVATION_SCHEMES)}")
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ModelLoadError(f"fp8 weight_strategy: invalid value '{self.weight_strategy}'; "
                                 f"accepted: {', '.join(WEIGHT_STRATEGIES)}")
        if self.weight_block_size is not None:
            size = tuple(self.weight_block_size)
            if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
                raise ModelLoadError(f"fp8 weight_block_size: invalid value {list(self.weight_block_size)}; "
                                     "accepted: two positive integers [rows, cols], e.g. [128, 128]")
            self.weight_block_size = (size[0], size[1])
        if (self.weight_strategy == "block") != (self.weight_block_size is not None):
            raise ModelLoadError(f"fp8 weight_block_size {self.weight_block_size} with weight_strategy "
                                 f"'{self.weight_strategy}': a block size goes with weight_strategy 'block' only, "
                                 "and 'block' needs one")
        if self.weight_strategy == "block" and self.activation_scheme != "dynamic":
            raise ModelLoadError("fp8 activation_scheme 'static' with block-wise weights is not supported; "
                                 "accepted with weight_block_size: dynamic")
        if self.weight_strategy != "tensor" and not self.checkpoint_serialized:
            raise ModelLoadError(f"fp8 weight_strategy '{self.weight_strategy}' describes a serialized checkpoint; "
                                 "on the fly (checkpoint_serialized=False) weights are always quantized per channel")

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any] | None = None) -> Fp8Config:
        """``{}`` (on-the-fly) or a checkpoint's ``quantization_config``; ``options``: the plugin's."""
        fuse = bool((options or {}).get("fuse_activation_quant", FUSE_ACTIVATION_QUANT))
        fast = bool((options or {}).get("fast_accum", FAST_ACCUM))
        if not config:
            return cls(fuse_activation_quant=fuse, fast_accum=fast)
        method = config.get("quant_method", "fp8")
        if method != "fp8":
            raise ModelLoadError(f"plugserve-quant-fp8: quantization_config.quant_method is '{method}'; accepted: fp8")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ModelLoadError(f"fp8 quantization_config.activation_scheme: invalid value '{scheme}'; "
                                 f"accepted: {', '.join(ACTIVATION_SCHEMES)}")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
        block = config.get("weight_block_size")
        if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2):
            raise ModelLoadError(f"fp8 quantization_config.weight_block_size: invalid value {block!r}; "
                                 "accepted: [rows, cols], e.g. [128, 128]")
        return cls(checkpoint_serialized=True, activation_scheme=scheme, ignored=tuple(ignored),
                   weight_strategy="block" if block is not None else "tensor",
                   weight_block_size=tuple(block) if block is not None else None, fuse_activation_quant=fuse,
                   fast_accum=fast)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        # Layers in ignored_layers() never get here: the layer SDK leaves them unquantized.
        from engine_quant_fp8.method import Fp8LinearMethod

        return Fp8LinearMethod(self)

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase | None:
        """FP8 experts: quantized per channel on the fly (``engine_quant_fp8.moe``), or a block-wise
        serialized checkpoint's (``engine_quant_fp8.moe_block``, DeepSeek-V3)."""
        if self.checkpoint_serialized and self.weight_strategy == "block":
            from engine_quant_fp8.moe_block import Fp8BlockMoEMethod

            assert self.weight_block_size is not None
            return Fp8BlockMoEMethod(self.weight_block_size, self.block_scale_name)
        if self.checkpoint_serialized:
            raise ModelLoadError(f"fp8: {prefix}: FP8-serialized mixture-of-experts checkpoints with {self.weight_strategy}-"
                                 "wise scales are not supported; accepted: block-wise (weight_block_size) checkpoints, "
                                 "or the 16-bit checkpoint with --quant fp8 (experts quantized per channel at load)")
        from engine_quant_fp8.moe import Fp8MoEMethod

        return Fp8MoEMethod()

    def ignored_layers(self) -> list[str]:
        return list(self.ignored)
