"""``Fp8Config`` built directly (the compressed-tensors plugin's entry) for each weight strategy,
and HF block-wise (``weight_block_size``) configs: loading into fused layers and the CPU forward.

The CPU forward dequantizes exactly (float32 maths), so every layer must equal ``F.linear`` on the
dequantized checkpoint shards to float32 rounding (assert_close defaults).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine.errors import ModelLoadError
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from engine_quant_fp8.config import Fp8Config
from engine_quant_fp8.quantize import (
    FP8_DTYPE,
    dequantize_per_block,
    quantize_per_block,
    quantize_per_channel,
    quantize_per_tensor,
)

CHANNEL = Fp8Config(checkpoint_serialized=True, activation_scheme="dynamic", weight_strategy="channel")
TENSOR = Fp8Config(checkpoint_serialized=True, activation_scheme="dynamic", weight_strategy="tensor")


def _block(scale_name: str = "weight_scale_inv", size: tuple[int, int] = (128, 128)) -> Fp8Config:
    return Fp8Config(checkpoint_serialized=True, activation_scheme="dynamic", weight_strategy="block",
                     weight_block_size=size, block_scale_name=scale_name)


def _randn(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Columns and rows of different magnitudes, so a misplaced tile scale shows.
    return torch.randn(rows, cols, generator=gen) * torch.logspace(-1, 1, cols)[None, :] \
        * torch.logspace(1, -1, rows)[:, None]


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: object = None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, *(() if shard is None else (shard,)))


def test_from_config_keeps_hf_defaults() -> None:
    cfg = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert (cfg.checkpoint_serialized, cfg.weight_strategy, cfg.weight_block_size) == (True, "tensor", None)
    block = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                                   "activation_scheme": "dynamic"})
    assert (block.weight_strategy, block.weight_block_size, block.block_scale_name) == \
        ("block", (128, 128), "weight_scale_inv")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"weight_strategy": "group"}, "weight_strategy"),
    ({"activation_scheme": "per_token"}, "activation_scheme"),
    ({"weight_strategy": "block"}, "weight_block_size"),
    ({"weight_strategy": "channel", "weight_block_size": (128, 128)}, "weight_block_size"),
    ({"weight_strategy": "block", "weight_block_size": (128, 128), "activation_scheme": "static"}, "static"),
    ({"weight_strategy": "block", "weight_block_size": (128, -1)}, "weight_block_size"),
])
def test_bad_direct_configs_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        Fp8Config(checkpoint_serialized=True, **kwargs)


def test_strategies_need_a_serialized_checkpoint() -> None:
    with pytest.raises(ModelLoadError, match="channel"):
        Fp8Config(weight_strategy="channel")


@pytest.mark.parametrize("scale_shape", ["column", "flat"])
def test_channel_scales_into_fused_qkv(scale_shape: str) -> None:
    layer = QKVParallelLinear(64, 16, 4, 2, bias=True, quant_config=CHANNEL, prefix="model.layers.0.self_attn.qkv_proj")
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (128,)
    parts = [quantize_per_channel(_randn(n, 64, seed)) for seed, n in enumerate((64, 32, 32))]
    for shard_id, (q, s) in zip("qkv", parts, strict=True):
        _load(layer, "weight", q, shard_id)
        _load(layer, "weight_scale", s[:, None] if scale_shape == "column" else s, shard_id)  # [N, 1] or [N]
        _load(layer, "bias", torch.full((q.shape[0],), 0.5), shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight_scale.shape == (128,) and layer.weight_scale.dtype == torch.float32
    dense = torch.cat([q.float() * s[:, None] for q, s in parts])
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), F.linear(x, dense, torch.full((128,), 0.5)))


def test_channel_static_input_scale() -> None:
    cfg = Fp8Config(checkpoint_serialized=True, activation_scheme="static", weight_strategy="channel")
    layer = MergedColumnParallelLinear(64, [48, 48], quant_config=cfg, prefix="model.layers.0.mlp.gate_up_proj")
    for shard_id, act in enumerate((0.2, 0.4)):
        q, s = quantize_per_channel(_randn(48, 64, shard_id))
        _load(layer, "weight", q, shard_id)
        _load(layer, "weight_scale", s[:, None], shard_id)
        _load(layer, "input_scale", torch.tensor(act), shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.input_scale.shape == () and layer.input_scale.item() == pytest.approx(0.4)


def test_tensor_strategy_is_the_hf_layout() -> None:
    layer = RowParallelLinear(64, 32, quant_config=TENSOR, prefix="model.layers.0.mlp.down_proj")
    w = _randn(32, 64, 3)
    q, s = quantize_per_tensor(w)
    _load(layer, "weight", q)
    _load(layer, "weight_scale", s)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, q.float() * s))


@pytest.mark.parametrize("scale_name", ["weight_scale_inv", "weight_scale"])
def test_block_scales_land_in_each_shards_rows(scale_name: str) -> None:
    # q 256 rows, k 128, v 128: shard boundaries on 128-row block boundaries; K = 320 leaves a partial column block.
    cfg = _block(scale_name)
    layer = QKVParallelLinear(320, 64, 4, 2, quant_config=cfg, prefix="model.layers.0.self_attn.qkv_proj")
    assert getattr(layer, scale_name).shape == (4, 3)
    parts = [quantize_per_block(_randn(n, 320, seed)) for seed, n in enumerate((256, 128, 128))]
    for shard_id, (q, s) in zip("qkv", parts, strict=True):
        _load(layer, "weight", q, shard_id)
        _load(layer, scale_name, s, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    # The forward reads one name whatever the checkpoint's.
    assert layer.weight_scale.shape == (4, 3) and not hasattr(layer, "weight_scale_inv")
    torch.testing.assert_close(layer.weight_scale, torch.cat([s for _, s in parts]))
    dense = torch.cat([dequantize_per_block(q, s, (128, 128), torch.float32) for q, s in parts])
    x = torch.randn(7, 320)
    torch.testing.assert_close(layer(x), F.linear(x, dense))


def test_block_gate_up_and_down() -> None:
    cfg = _block()
    gate_up = MergedColumnParallelLinear(128, [256, 256], quant_config=cfg, prefix="model.layers.0.mlp.gate_up_proj")
    down = RowParallelLinear(256, 128, bias=True, quant_config=cfg, prefix="model.layers.0.mlp.down_proj")
    parts = [quantize_per_block(_randn(256, 128, seed)) for seed in (5, 6)]
    for shard_id, (q, s) in enumerate(parts):
        _load(gate_up, "weight", q, shard_id)
        _load(gate_up, "weight_scale_inv", s, shard_id)
    qd, sd = quantize_per_block(_randn(128, 256, 7))
    _load(down, "weight", qd)
    _load(down, "weight_scale_inv", sd)
    _load(down, "bias", torch.ones(128))
    for layer in (gate_up, down):
        layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(4, 128)
    dense = torch.cat([dequantize_per_block(q, s, (128, 128), torch.float32) for q, s in parts])
    torch.testing.assert_close(gate_up(x), F.linear(x, dense))
    h = torch.randn(4, 256)
    torch.testing.assert_close(down(h), F.linear(h, dequantize_per_block(qd, sd, (128, 128), torch.float32), torch.ones(128)))


def test_block_single_shard_with_partial_row_block() -> None:
    layer = ReplicatedLinear(200, 72, quant_config=_block(), prefix="lm_head")
    q, s = quantize_per_block(_randn(72, 200, 8))
    assert s.shape == (1, 2)
    _load(layer, "weight", q)
    _load(layer, "weight_scale_inv", s)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(2, 200)
    torch.testing.assert_close(layer(x), F.linear(x, dequantize_per_block(q, s, (128, 128), torch.float32)))


def test_block_fused_shards_must_align() -> None:
    with pytest.raises(ModelLoadError, match=r"qkv_proj.*multiple of 128"):
        QKVParallelLinear(64, 16, 4, 2, quant_config=_block(), prefix="model.layers.0.self_attn.qkv_proj")


def test_block_quantizer_round_trip() -> None:
    w = _randn(300, 200, 9)
    q, s = quantize_per_block(w, (128, 128))
    assert q.dtype == FP8_DTYPE and s.shape == (3, 2)
    # Each tile's max maps onto 448 (the top of e4m3), and the round trip is within half an e4m3 step.
    deq = dequantize_per_block(q, s, (128, 128), torch.float32)
    assert ((deq - w).abs() <= w.abs() * 2**-4 + 2**-10 * s.max()).all()
    torch.testing.assert_close(s[0, 0], w[:128, :128].abs().max() / 448)
