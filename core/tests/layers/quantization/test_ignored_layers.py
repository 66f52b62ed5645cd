"""QuantizationConfig.ignored_layers() is honoured by the layer SDK, for every quant method."""

from __future__ import annotations

from typing import Any

import pytest

from engine.errors import ModelLoadError
from engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from engine.layers.quantization import LinearMethodBase, QuantizationConfig, is_layer_ignored


class _Marked(UnquantizedLinearMethod):
    """Stands for a quantized method; only its type matters here."""


class _QuantizesEverything(QuantizationConfig):
    """A method that never looks at ignored_layers() itself: the SDK must."""

    name = "everything"

    def __init__(self, ignored: list[str]) -> None:
        self.ignored = ignored

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _QuantizesEverything:
        return cls(list(config.get("ignored_layers", [])))

    def get_linear_method(self, layer: Any, prefix: str) -> LinearMethodBase:
        return _Marked()

    def ignored_layers(self) -> list[str]:
        return self.ignored


def test_listed_layers_stay_unquantized_fused_ones_when_every_part_is() -> None:
    cfg = _QuantizesEverything(["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                "model.layers.0.self_attn.v_proj", "down_proj"])
    qkv = QKVParallelLinear(64, 16, 4, 2, quant_config=cfg, prefix="model.layers.0.self_attn.qkv_proj")
    assert type(qkv.quant_method) is UnquantizedLinearMethod
    # A short name matches that layer in every block.
    down = RowParallelLinear(64, 32, quant_config=cfg, prefix="model.layers.3.mlp.down_proj")
    assert type(down.quant_method) is UnquantizedLinearMethod
    other_qkv = QKVParallelLinear(64, 16, 4, 2, quant_config=cfg, prefix="model.layers.1.self_attn.qkv_proj")
    assert isinstance(other_qkv.quant_method, _Marked)


def test_partly_ignored_fused_layer_is_an_error() -> None:
    cfg = _QuantizesEverything(["model.layers.0.mlp.up_proj"])
    with pytest.raises(ModelLoadError, match="only some of .*gate_proj, .*up_proj unquantized; .*gate_up_proj"):
        MergedColumnParallelLinear(64, [48, 48], quant_config=cfg, prefix="model.layers.0.mlp.gate_up_proj")


def test_matching_is_by_whole_name_parts() -> None:
    assert is_layer_ignored("lm_head", ["lm_head"])
    assert not is_layer_ignored("model.layers.0.mlp.my_down_proj", ["down_proj"])
    assert not is_layer_ignored("model.layers.0.mlp.down_proj", [])
