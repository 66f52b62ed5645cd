"""Checkpoint KV-cache scales: which names carry them, what RadixAttention accepts, and which
attention backends the engine lets store fp8 K/V."""

from __future__ import annotations

import pytest
import torch

from engine.attention import check_backend_selectable
from engine.errors import ConfigError, ModelLoadError
from engine.hookspecs import AttentionBackendSpec
from engine.layers.radix_attention import RadixAttention, kv_scale_target
from engine.mem_cache.memory_pool import dequantize_kv, quantize_kv, resolve_kv_cache_dtype


@pytest.mark.parametrize(("name", "target"), [
    ("model.layers.3.self_attn.k_scale", ("model.layers.3.self_attn", "k")),  # llm-compressor
    ("model.layers.3.self_attn.v_scale", ("model.layers.3.self_attn", "v")),
    ("model.layers.3.self_attn.attn.k_scale", ("model.layers.3.self_attn", "k")),  # vLLM's own layout
    ("model.layers.3.self_attn.k_proj.output_scale", ("model.layers.3.self_attn", "k")),  # AutoFP8
    ("model.layers.3.self_attn.v_proj.v_scale", ("model.layers.3.self_attn", "v")),  # ModelOpt
    ("model.layers.3.self_attn.k_proj.weight_scale", None),
    ("model.layers.3.self_attn.k_proj.input_scale", None),
    ("model.layers.3.self_attn.k_proj.weight", None),
])
def test_kv_scale_names(name: str, target: tuple[str, str] | None) -> None:
    assert kv_scale_target(name) == target


def test_load_kv_scale_accepts_one_positive_number() -> None:
    attn = RadixAttention(4, 16, 0.25, 2, layer_id=5)
    assert (attn.k_scale, attn.v_scale) == (1.0, 1.0)
    attn.load_kv_scale("k", torch.tensor(0.5))
    attn.load_kv_scale("v", torch.tensor([0.25], dtype=torch.bfloat16))
    assert (attn.k_scale, attn.v_scale) == (0.5, 0.25)
    with pytest.raises(ModelLoadError, match=r"layer 5: v_scale has shape \(2,\); accepted: one per-tensor scale"):
        attn.load_kv_scale("v", torch.ones(2))
    with pytest.raises(ModelLoadError, match=r"layer 5: k_scale is nan; accepted: a finite number > 0"):
        attn.load_kv_scale("k", torch.tensor(float("nan")))


def test_quantize_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 3.0, 0.0])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = quantize_kv(x, dtype, 0.5)
        assert q.dtype == dtype
        limit = torch.finfo(dtype).max
        assert q.float().tolist() == [limit, -limit, 6.0, 0.0]
        assert dequantize_kv(q, torch.float32, 0.5).tolist() == [limit / 2, -limit / 2, 3.0, 0.0]
    assert quantize_kv(x, torch.float32, 0.5) is not None and quantize_kv(x, torch.float32, 0.5).tolist() == x.tolist()


def test_kv_cache_dtype_names() -> None:
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype: invalid value 'int8'; accepted: auto, fp8_e4m3, fp8_e5m2"):
        resolve_kv_cache_dtype("int8", torch.bfloat16)


def test_backend_without_fp8_kv_is_refused_by_name() -> None:
    spec = AttentionBackendSpec(name="mine", factory="x:y", device_types=("cpu",))
    check_backend_selectable(spec, "cpu", 1)  # "auto" is always accepted
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype: attention backend 'mine' does not support "
                                          r"'fp8_e4m3' \(it supports: auto\)"):
        check_backend_selectable(spec, "cpu", 1, "fp8_e4m3")
