"""Loading FP8-serialized weights into fused layers: per-shard scales become per-channel ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine.errors import ModelLoadError
from engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from engine_quant_fp8.config import Fp8Config
from engine_quant_fp8.method import Fp8LinearMethod
from engine_quant_fp8.quantize import FP8_DTYPE, dequantize_per_channel, quantize_per_tensor

DYNAMIC = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
STATIC = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static"})


def _shard(rows: int, cols: int, magnitude: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float weight, fp8 weight, per-tensor scale as a 0-d tensor) of one checkpoint projection."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * magnitude
    q, scale = quantize_per_tensor(w)
    return w, q, scale


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: object = None) -> None:
    param = getattr(layer, name)
    if shard is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard)


def _dequant_cat(shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([q.float() * s for _, q, s in shards])


def test_qkv_per_shard_scales_become_per_channel() -> None:
    # 4 query heads over 2 KV heads of 16: q 64 rows, k 32, v 32; magnitudes 100x apart.
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=DYNAMIC, prefix="model.layers.0.self_attn.qkv_proj")
    assert isinstance(layer.quant_method, Fp8LinearMethod)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (3,)
    shards = [_shard(64, 64, 0.1, 1), _shard(32, 64, 1.0, 2), _shard(32, 64, 10.0, 3)]
    for shard_id, (_, q, s) in zip("qkv", shards, strict=True):
        _load(layer, "weight", q, shard_id)
        _load(layer, "weight_scale", s, shard_id)  # stored as a 0-d tensor, like AutoFP8
    layer.quant_method.process_weights_after_loading(layer)

    expected_scale = torch.cat([s.expand(n) for (_, _, s), n in zip(shards, (64, 32, 32), strict=True)])
    assert torch.equal(layer.weight_scale, expected_scale)
    # The fp8 codes are not requantized: the conversion is exact.
    assert torch.equal(layer.weight.view(torch.uint8), torch.cat([q for _, q, _ in shards]).view(torch.uint8))
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), F.linear(x, _dequant_cat(shards)))
    # Against the float weights, each shard keeps its own precision (no shard borrows another's scale).
    ref = F.linear(x.double(), torch.cat([w for w, _, _ in shards]).double())
    for got_part, ref_part in zip(layer(x).double().split([64, 32, 32], dim=1), ref.split([64, 32, 32], dim=1), strict=True):
        assert (got_part - ref_part).norm() / ref_part.norm() < 0.05


def test_gate_up_scales_stored_as_one_element_vectors() -> None:
    layer = MergedColumnParallelLinear(64, [48, 48], quant_config=DYNAMIC, prefix="model.layers.0.mlp.gate_up_proj")
    shards = [_shard(48, 64, 0.5, 4), _shard(48, 64, 5.0, 5)]
    for shard_id, (_, q, s) in enumerate(shards):
        _load(layer, "weight", q, shard_id)
        _load(layer, "weight_scale", s.reshape(1), shard_id)  # some exporters write [1]
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(layer.weight_scale, torch.cat([shards[0][2].expand(48), shards[1][2].expand(48)]))
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, _dequant_cat(shards)))


@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_row_parallel_scalar_scale(scale_shape: tuple[int, ...]) -> None:
    layer = RowParallelLinear(64, 32, bias=True, quant_config=DYNAMIC, prefix="model.layers.0.mlp.down_proj")
    _, q, s = _shard(32, 64, 2.0, 6)
    _load(layer, "weight", q)
    _load(layer, "weight_scale", s.reshape(scale_shape))
    _load(layer, "bias", torch.arange(32, dtype=torch.float32))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), F.linear(x, q.float() * s, torch.arange(32, dtype=torch.float32)))


def test_static_input_scales_merge_to_the_largest() -> None:
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=STATIC, prefix="model.layers.0.self_attn.qkv_proj")
    assert layer.input_scale.shape == (3,)
    for shard_id, (_, q, s), act in zip("qkv", [_shard(64, 64, 1, 7), _shard(32, 64, 1, 8), _shard(32, 64, 1, 9)],
                                        (0.1, 0.3, 0.2), strict=True):
        _load(layer, "weight", q, shard_id)
        _load(layer, "weight_scale", s, shard_id)
        _load(layer, "input_scale", torch.tensor(act), shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.input_scale.shape == () and layer.input_scale.item() == pytest.approx(0.3)


def test_on_the_fly_quantizes_per_channel_after_loading() -> None:
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=Fp8Config.from_config({}), prefix="qkv_proj")
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "weight_scale")
    w = torch.randn(128, 64) * torch.logspace(-2, 2, 128)[:, None]
    for shard_id, part in zip("qkv", w.split([64, 32, 32]), strict=True):
        _load(layer, "weight", part, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (128,)
    deq = dequantize_per_channel(layer.weight, layer.weight_scale, torch.float32)
    assert ((deq - w).norm(dim=1) / w.norm(dim=1)).max() < 0.05


def test_ignored_layers_stay_unquantized() -> None:
    cfg = Fp8Config.from_config({"quant_method": "fp8", "ignored_layers": [
        "lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]})
    assert isinstance(QKVParallelLinear(64, 16, 4, 2, quant_config=cfg, prefix="model.layers.0.self_attn.qkv_proj").quant_method,
                      UnquantizedLinearMethod)
    assert isinstance(RowParallelLinear(64, 32, quant_config=cfg, prefix="model.layers.1.mlp.down_proj").quant_method,
                      UnquantizedLinearMethod)
    assert isinstance(RowParallelLinear(64, 32, quant_config=cfg, prefix="model.layers.0.mlp.down_proj").quant_method,
                      Fp8LinearMethod)


def test_partly_ignored_fused_layer_is_an_error() -> None:
    cfg = Fp8Config.from_config({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.gate_proj"]})
    with pytest.raises(ModelLoadError, match="gate_up_proj"):
        MergedColumnParallelLinear(64, [48, 48], quant_config=cfg, prefix="model.layers.0.mlp.gate_up_proj")


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "fp8", "activation_scheme": "per_tensor"}, "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static"),
    ({"quant_method": "awq"}, "quant_method"),
])
def test_bad_checkpoint_configs_are_named(config: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        Fp8Config.from_config(config)
