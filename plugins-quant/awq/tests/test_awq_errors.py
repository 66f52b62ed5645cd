"""Bad AWQ input is one clear ModelLoadError; ``--load-format dummy`` loads and generates."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from engine.errors import ModelLoadError
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.testing.harness import assert_generates, make_scheduler
from engine_quant_awq.config import AwqConfig
from engine_quant_awq.format import pack_awq
from engine_quant_wna16.checkpoints import write_quantized_checkpoint
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM",
                                hidden_size=128, intermediate_size=256)


def _awq(base: str, tmp_path: Any, group_size: int = 64, **config: Any) -> str:
    cfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm", **config}
    return write_quantized_checkpoint(base, f"{tmp_path}/awq", f"{tmp_path}/ref", cfg, pack_awq,
                                      group_size=group_size)[0]


def _edit_config(path: str, **changes: Any) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_group_size_not_dividing_the_input(base: str, tmp_path: Any) -> None:
    path = _awq(base, tmp_path)
    _edit_config(path, group_size=96)  # 96 does not divide the 128 inputs of q_proj
    with pytest.raises(ModelLoadError, match=r"group_size 96 does not divide the layer's input size 128"):
        make_scheduler(path)


def test_scales_of_another_group_size(base: str, tmp_path: Any) -> None:
    path = _awq(base, tmp_path, group_size=64)
    _edit_config(path, group_size=32)  # the tensors hold groups of 64
    with pytest.raises(ModelLoadError, match=r"awq checkpoint tensor .*qzeros.* does not fit .*group_size=32"):
        make_scheduler(path)


def test_mismatched_qweight_shape(base: str, tmp_path: Any) -> None:
    path = _awq(base, tmp_path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.0.mlp.down_proj.qweight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, file)
    with pytest.raises(ModelLoadError, match=r"down_proj\.qweight of shape \(256, 15\) does not fit parameter \(256, 16\)"):
        make_scheduler(path)


def test_quant_awq_on_a_gptq_checkpoint(base: str, tmp_path: Any) -> None:
    path = _awq(base, tmp_path)
    _edit_config(path, quant_method="gptq")
    with pytest.raises(ModelLoadError, match=r"--quant awq conflicts with the checkpoint's quantization_config \(quant_method 'gptq'\)"):
        make_scheduler(path, quant="awq")


def test_quant_awq_without_a_quantized_checkpoint(base: str) -> None:
    with pytest.raises(ModelLoadError, match="--quant awq loads AWQ checkpoints only"):
        make_scheduler(base, quant="awq")


@pytest.mark.parametrize(("change", "message"), [
    ({"version": "gemv"}, "version: 'gemv' is not supported; accepted: gemm"),
    ({"bits": 3}, "bits: 3 is not supported; accepted: 4"),
    ({"zero_point": False}, "zero_point: false is not supported"),
    ({"group_size": 100}, "group_size: invalid value 100"),
])
def test_unsupported_config(change: dict[str, Any], message: str) -> None:
    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm", **change}
    with pytest.raises(ModelLoadError, match=message):
        AwqConfig.from_config(config)


def test_dummy_weights_load_and_generate(base: str, tmp_path: Any) -> None:
    """``--load-format dummy`` leaves int tensors uninitialised: any bit pattern is a valid code."""
    path = _awq(base, tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    scheduler = make_scheduler(path, load_format="dummy")
    layer = scheduler.runner.model.model.layers[0].mlp.gate_up_proj
    assert layer.wna16_qweight.dtype == torch.int32 and layer.wna16_qweight.shape == (128 // 8, 512)
    assert_generates(path, [[5, 6, 7]], 4, load_format="dummy")
