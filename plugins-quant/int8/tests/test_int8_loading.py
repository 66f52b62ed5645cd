"""Loading ``w8a8_int8`` checkpoints (SGLang layout) into fused and row-parallel layers."""

from __future__ import annotations

import pytest
import torch
from engine.errors import ModelLoadError
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine_quant_int8.config import W8A8Int8Config
from engine_quant_int8.gemm import int8_linear
from engine_quant_int8.method import W8A8Int8LinearMethod
from engine_quant_int8.quantize import quantize_per_channel

SERIALIZED = W8A8Int8Config.from_config({"quant_method": "w8a8_int8"})


def _shard(rows: int, cols: int, magnitude: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, per-channel scale ``[rows, 1]``) of one checkpoint projection."""
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize_per_channel(torch.randn(rows, cols, generator=gen) * magnitude)
    return q, scale[:, None]


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: object = None) -> None:
    param = getattr(layer, name)
    if shard is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard)


def test_qkv_per_channel_scales_follow_their_rows() -> None:
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=SERIALIZED, prefix="model.layers.0.self_attn.qkv_proj")
    assert isinstance(layer.quant_method, W8A8Int8LinearMethod)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (128,)
    shards = [_shard(64, 64, 0.1, 1), _shard(32, 64, 1.0, 2), _shard(32, 64, 10.0, 3)]
    for shard_id, (q, s) in zip("qkv", shards, strict=True):
        _load(layer, "weight", q, shard_id)
        _load(layer, "weight_scale", s, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(layer.weight, torch.cat([q for q, _ in shards]))
    assert torch.equal(layer.weight_scale, torch.cat([s.reshape(-1) for _, s in shards]))
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), int8_linear(x, layer.weight, layer.weight_scale))


def test_gate_up_and_row_parallel_accept_flat_scales() -> None:
    gate_up = MergedColumnParallelLinear(64, [48, 48], quant_config=SERIALIZED, prefix="mlp.gate_up_proj")
    shards = [_shard(48, 64, 0.5, 4), _shard(48, 64, 5.0, 5)]
    for shard_id, (q, s) in enumerate(shards):
        _load(gate_up, "weight", q, shard_id)
        _load(gate_up, "weight_scale", s.reshape(-1), shard_id)  # [out] instead of [out, 1]
    assert torch.equal(gate_up.weight_scale, torch.cat([s.reshape(-1) for _, s in shards]))

    down = RowParallelLinear(64, 32, quant_config=SERIALIZED, prefix="mlp.down_proj")
    q, s = _shard(32, 64, 2.0, 6)
    _load(down, "weight", q)
    _load(down, "weight_scale", s)
    down.quant_method.process_weights_after_loading(down)
    assert torch.equal(down.weight_scale, s.reshape(-1))


def test_on_the_fly_quantizes_after_loading() -> None:
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=W8A8Int8Config.from_config({}), prefix="qkv_proj")
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "weight_scale")
    w = torch.randn(128, 64)
    for shard_id, part in zip("qkv", w.split([64, 32, 32]), strict=True):
        _load(layer, "weight", part, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    q, s = quantize_per_channel(w)
    assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, s)


def test_other_checkpoint_methods_are_rejected() -> None:
    with pytest.raises(ModelLoadError, match="w8a8_int8"):
        W8A8Int8Config.from_config({"quant_method": "w8a8_fp8"})


def test_static_input_scales_load_per_shard_and_keep_the_largest() -> None:
    config = W8A8Int8Config.from_config({"quant_method": "w8a8_int8", "activation_scheme": "static"})
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=config, prefix="model.layers.0.self_attn.qkv_proj")
    assert layer.input_scale.shape == (3,)
    for shard_id, (rows, value) in zip("qkv", [(64, 0.02), (32, 0.05), (32, 0.03)], strict=True):
        q, s = _shard(rows, 64, 1.0, rows)
        _load(layer, "weight", q, shard_id)
        _load(layer, "weight_scale", s, shard_id)
        _load(layer, "input_scale", torch.tensor(value), shard_id)  # stored as a 0-d tensor
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.input_scale.shape == (1,) and layer.input_scale.item() == pytest.approx(0.05)
    down = RowParallelLinear(64, 32, quant_config=config, prefix="mlp.down_proj")
    _load(down, "input_scale", torch.tensor([0.07]))
    down.quant_method.process_weights_after_loading(down)
    assert down.input_scale.item() == pytest.approx(0.07)


def test_unknown_activation_scheme_is_rejected() -> None:
    with pytest.raises(ModelLoadError, match="activation_scheme.*'per_group'.*dynamic, static"):
        W8A8Int8Config.from_config({"quant_method": "w8a8_int8", "activation_scheme": "per_group"})
