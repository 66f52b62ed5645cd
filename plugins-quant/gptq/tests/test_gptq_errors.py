"""Bad GPTQ input is one clear ModelLoadError; ``--load-format dummy`` loads and generates."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import pytest
import torch
from engine.errors import ModelLoadError
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.testing.harness import assert_generates, make_scheduler
from engine_quant_gptq.config import GptqConfig
from engine_quant_gptq.format import pack_gptq
from engine_quant_wna16.checkpoints import write_quantized_checkpoint
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM",
                                hidden_size=128, intermediate_size=256)


def _gptq(base: str, tmp_path: Any, desc_act: bool = True) -> str:
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": desc_act}
    return write_quantized_checkpoint(base, f"{tmp_path}/gptq", f"{tmp_path}/ref", cfg, functools.partial(pack_gptq),
                                      group_size=32, act_order=desc_act)[0]


def _edit(path: str, **changes: Any) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _edit_tensor(path: str, name: str, fn: Any) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors[name] = fn(tensors[name]).contiguous()
    save_file(tensors, file)


def test_group_size_not_dividing_the_input(base: str, tmp_path: Any) -> None:
    path = _gptq(base, tmp_path)
    _edit(path, group_size=48)
    with pytest.raises(ModelLoadError, match=r"group_size 48 does not divide the layer's input size 128"):
        make_scheduler(path)


def test_g_idx_disagreeing_with_group_size(base: str, tmp_path: Any) -> None:
    path = _gptq(base, tmp_path)
    _edit_tensor(path, "model.layers.0.mlp.down_proj.g_idx", lambda g: torch.zeros_like(g))  # all in group 0
    with pytest.raises(ModelLoadError, match=r"down_proj: g_idx does not put 32 input channels in each group"):
        make_scheduler(path)


def test_fused_shards_with_different_g_idx(base: str, tmp_path: Any) -> None:
    path = _gptq(base, tmp_path)
    _edit_tensor(path, "model.layers.0.self_attn.k_proj.g_idx", lambda g: torch.arange(g.numel()) // 32)
    with pytest.raises(ModelLoadError, match=r"qkv_proj: the fused projections' g_idx differ"):
        make_scheduler(path)


def test_mismatched_scales_shape(base: str, tmp_path: Any) -> None:
    path = _gptq(base, tmp_path)
    _edit_tensor(path, "model.layers.1.mlp.up_proj.scales", lambda s: s[:, :-8])
    with pytest.raises(ModelLoadError, match=r"gptq checkpoint tensor model\.layers\.1\.mlp\.gate_up_proj\.scales \(shard 1\) "
                                             r"of shape \(4, 248\) does not fit"):
        make_scheduler(path)


def test_quant_gptq_on_an_awq_checkpoint(base: str, tmp_path: Any) -> None:
    path = _gptq(base, tmp_path)
    _edit(path, quant_method="awq")
    with pytest.raises(ModelLoadError, match=r"--quant gptq conflicts with the checkpoint's quantization_config"):
        make_scheduler(path, quant="gptq")


@pytest.mark.parametrize(("change", "message"), [
    ({"bits": 3}, "bits: 3 is not supported; accepted: 4, 8"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format: 'marlin' is not supported; accepted: gptq, gptq_v2"),
    ({"lm_head": True}, "lm_head: true"),
    ({"group_size": 0}, "group_size: invalid value 0"),
])
def test_unsupported_config(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        GptqConfig.from_config({"quant_method": "gptq", "bits": 4, "group_size": 128, **change})


def test_dummy_weights_load_and_generate(base: str, tmp_path: Any) -> None:
    """``--load-format dummy`` leaves int tensors (g_idx too) as created: plain groups, any codes."""
    path = _gptq(base, tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    scheduler = make_scheduler(path, load_format="dummy")
    layer = scheduler.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.wna16_perm is None and layer.wna16_qweight.shape == (128 // 8, 256)
    assert_generates(path, [[5, 6, 7]], 4, load_format="dummy")
