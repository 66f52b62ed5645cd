"""``CompressedTensorsConfig``: llm-compressor's ``quantization_config`` mapped onto our methods.

Each ``config_groups`` entry pairs ``targets`` (``"Linear"``, a layer name, or ``"re:<regex>"``
matched from the start of the checkpoint's layer name) with a scheme. Two kinds are served:

- int weights, no activation quantization, ``format: pack-quantized`` (W4A16 / W8A16, group or
  channel scales, symmetric or not): ``CompressedTensorsWNA16Method`` on the wna16 kernels;
- FP8 weights (``type: float``, 8 bits, ``format: float-quantized`` or ``naive-quantized``) with
  dynamic, static or no input quantization: an ``Fp8Config`` of the fp8 plugin built from the
  scheme, whose method reads the same tensor names (``weight``, ``weight_scale``, ``input_scale``).

Anything else (other formats, int8 activations, sparsity, a KV-cache scheme) is one
``ModelLoadError`` naming the field and what is accepted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from engine.errors import ModelLoadError
from engine.layers.quantization import FUSED_LAYER_PARTS, LinearMethodBase, QuantizationConfig
from engine_quant_wna16.layout import check_group_size_field

if TYPE_CHECKING:
    from torch import nn

INT_FORMATS = ("pack-quantized",)
FP8_FORMATS = ("float-quantized", "naive-quantized")
_ACCEPTED = ("int weights of 4 or 8 bits with input_activations null and format pack-quantized (W4A16, W8A16); "
             "float weights of 8 bits with format float-quantized (FP8)")


@dataclass(frozen=True)
class IntScheme:
    """Weight-only int quantization, stored pack-quantized."""

    num_bits: int
    symmetric: bool
    #: inputs per group; -1 for ``strategy: channel`` (one group per output channel).
    group_size: int
    #: ``actorder: group``: the checkpoint has a ``weight_g_idx`` per projection.
    has_g_idx: bool


def _strategy(weights: dict[str, Any]) -> str:
    # compressed-tensors infers the strategy from group_size when absent.
    strategy = weights.get("strategy")
    if strategy is not None:
        return str(strategy).lower()
    group_size = weights.get("group_size")
    return "tensor" if group_size is None else "channel" if group_size == -1 else "group"


def _parse_int(where: str, weights: dict[str, Any], inputs: Any, fmt: str) -> IntScheme:
    if inputs is not None:
        raise ModelLoadError(f"{where}.input_activations: int weights with quantized activations (W{weights.get('num_bits')}A"
                             f"{inputs.get('num_bits')}) are not supported by plugserve-quant-compressed-tensors; "
                             f"accepted: {_ACCEPTED}")
    if fmt not in INT_FORMATS:
        raise ModelLoadError(f"{where}.format: '{fmt}' for int weights is not supported; accepted: {', '.join(INT_FORMATS)}")
    bits = weights.get("num_bits")
    if bits not in (4, 8):
        raise ModelLoadError(f"{where}.weights.num_bits: {bits} is not supported; accepted: 4, 8")
    strategy = _strategy(weights)
    if strategy == "group":
        group_size = weights.get("group_size")
        check_group_size_field(group_size, f"{where}.weights.group_size")
    elif strategy == "channel":
        group_size = -1
    else:
        raise ModelLoadError(f"{where}.weights.strategy: '{strategy}' is not supported for int weights; "
                             "accepted: group, channel")
    actorder = weights.get("actorder")
    return IntScheme(num_bits=bits, symmetric=bool(weights.get("symmetric", True)), group_size=group_size,
                     has_g_idx=str(actorder).lower() in ("group", "dynamic"))


def _parse_fp8(where: str, weights: dict[str, Any], inputs: Any, fmt: str, ignored: tuple[str, ...]) -> Any:
    from engine_quant_fp8.config import Fp8Config

    if fmt not in FP8_FORMATS:
        raise ModelLoadError(f"{where}.format: '{fmt}' for FP8 weights is not supported; accepted: {', '.join(FP8_FORMATS)}")
    strategy = _strategy(weights)
    if strategy not in ("tensor", "channel", "block"):
        raise ModelLoadError(f"{where}.weights.strategy: '{strategy}' is not supported for FP8 weights; "
                             "accepted: tensor, channel, block")
    block = weights.get("block_structure")
    if strategy == "block" and (not isinstance(block, (list, tuple)) or len(block) != 2):
        raise ModelLoadError(f"{where}.weights.block_structure: invalid value {block!r}; accepted: [rows, cols]")
    scheme = "dynamic"
    if inputs is not None:
        if inputs.get("type", "float") != "float" or inputs.get("num_bits") != 8:
            raise ModelLoadError(f"{where}.input_activations: {inputs.get('type')} {inputs.get('num_bits')}-bit is not "
                                 "supported with FP8 weights; accepted: float 8-bit (dynamic or static), or null")
        scheme = "dynamic" if inputs.get("dynamic", False) else "static"
    return Fp8Config(checkpoint_serialized=True, activation_scheme=scheme, weight_strategy=strategy,
                     weight_block_size=tuple(block) if strategy == "block" else None,
                     block_scale_name="weight_scale", ignored=ignored)


def _matches(name: str, target: str) -> bool:
    if target == "Linear":  # the class every linear layer of a checkpoint is
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


@dataclass
class CompressedTensorsConfig(QuantizationConfig):
    """Parsed ``config_groups`` (in order: the first group whose targets match a layer wins)."""

    #: ``(group name, targets, IntScheme | Fp8Config)``.
    groups: tuple[tuple[str, tuple[str, ...], Any], ...] = ()
    #: the checkpoint's ``ignore`` list (names, or ``re:`` patterns).
    ignore: tuple[str, ...] = ()

    name = "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        if not config:
            raise ModelLoadError("--quant compressed-tensors loads compressed-tensors checkpoints only, and config.json "
                                 "has no quantization_config; quantize the model with llm-compressor")
        method = config.get("quant_method")
        if method != "compressed-tensors":
            raise ModelLoadError(f"plugserve-quant-compressed-tensors: quantization_config.quant_method is '{method}'; "
                                 "accepted: compressed-tensors")
        where = "compressed-tensors quantization_config"
        for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
            if config.get(key):
                raise ModelLoadError(f"{where}.{key} is not supported by plugserve-quant-compressed-tensors; "
                                     "accepted: absent or null")
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ModelLoadError(f"{where}.quantization_status: '{status}' is not supported; accepted: compressed")
        ignore = tuple(config.get("ignore") or ())
        plain_ignore = tuple(i for i in ignore if not i.startswith("re:"))
        groups_cfg = config.get("config_groups") or {}
        if not groups_cfg:
            raise ModelLoadError(f"{where}.config_groups is empty; accepted: at least one scheme")
        groups = []
        for name, group in groups_cfg.items():
            gwhere = f"{where}.config_groups.{name}"
            if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
                raise ModelLoadError(f"{gwhere}.weights: missing; accepted: {_ACCEPTED}")
            weights, inputs = group["weights"], group.get("input_activations")
            if group.get("output_activations") is not None:
                raise ModelLoadError(f"{gwhere}.output_activations is not supported; accepted: null")
            fmt = str(group.get("format") or config.get("format") or "")
            kind, bits = str(weights.get("type", "int")).lower(), weights.get("num_bits")
            if kind == "int":
                scheme: Any = _parse_int(gwhere, weights, inputs, fmt)
            elif kind == "float" and bits == 8:
                scheme = _parse_fp8(gwhere, weights, inputs, fmt, plain_ignore)
            else:
                raise ModelLoadError(f"{gwhere}.weights: {kind} {bits}-bit weights (format '{fmt}') are not supported; "
                                     f"accepted: {_ACCEPTED}")
            targets = group.get("targets") or []
            groups.append((name, tuple([targets] if isinstance(targets, str) else targets), scheme))
        return cls(groups=tuple(groups), ignore=ignore)

    def scheme_for(self, prefix: str) -> Any:
        """The scheme of the layer at ``prefix`` (None: unquantized). A fused layer's parts
        (q/k/v, gate/up) must share one, as one fused weight has one format."""
        parent, _, leaf = prefix.rpartition(".")
        parts = [f"{parent}.{p}" if parent else p for p in FUSED_LAYER_PARTS.get(leaf, (leaf,))]
        found = [self._scheme_of_part(part) for part in parts]
        groups = {f[0] if f else None for f in found}
        if len(groups) > 1:
            names = ", ".join(f"{p}: {f[0] if f else 'unquantized'}" for p, f in zip(parts, found))
            raise ModelLoadError(f"compressed-tensors: the engine fuses {', '.join(parts)} into {prefix}, but the "
                                 f"checkpoint quantizes them differently ({names})")
        return None if found[0] is None else found[0][1]

    def _scheme_of_part(self, name: str) -> tuple[str, Any] | None:
        if any(i.startswith("re:") and _matches(name, i) for i in self.ignore):
            return None
        for group_name, targets, scheme in self.groups:
            if any(_matches(name, t) for t in targets):
                return group_name, scheme
        return None

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        scheme = self.scheme_for(prefix)
        if scheme is None:
            return None
        if isinstance(scheme, IntScheme):
            from engine_quant_compressed_tensors.method import CompressedTensorsWNA16Method

            return CompressedTensorsWNA16Method(scheme)
        return scheme.get_linear_method(layer, prefix)

    def supported_act_dtypes(self) -> list[torch.dtype]:
        accepted = [torch.float16, torch.bfloat16, torch.float32]
        for _, _, scheme in self.groups:
            if not isinstance(scheme, IntScheme):
                accepted = [d for d in accepted if d in scheme.supported_act_dtypes()]
        return accepted

    def ignored_layers(self) -> list[str]:
        # ``re:`` patterns are applied in scheme_for (the layer SDK matches names only).
        return [i for i in self.ignore if not i.startswith("re:")]
