"""Schemes the plugin does not serve, and bad checkpoints, are one clear ModelLoadError each."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from engine.errors import ModelLoadError
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.testing.harness import assert_generates, make_scheduler
from engine_quant_compressed_tensors.config import CompressedTensorsConfig
from engine_quant_compressed_tensors.format import pack_compressed
from engine_quant_compressed_tensors.testing import int_config
from engine_quant_wna16.checkpoints import write_quantized_checkpoint
from safetensors.torch import load_file, save_file


def _with(config: dict[str, Any], **weights: Any) -> dict[str, Any]:
    config = copy.deepcopy(config)
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


@pytest.mark.parametrize(("config", "message"), [
    (_with(int_config(4, 128, True), num_bits=2), r"group_0\.weights\.num_bits: 2 is not supported; accepted: 4, 8"),
    (_with(int_config(4, 128, True), type="float", num_bits=4),
     r"group_0\.weights: float 4-bit weights \(format 'pack-quantized'\) are not supported; accepted: int weights"),
    (_with(int_config(4, 128, True), strategy="block"), r"weights\.strategy: 'block' is not supported for int weights"),
    (_with(int_config(4, 128, True), group_size=100), r"weights\.group_size: invalid value 100"),
    ({**int_config(4, 128, True), "config_groups": {"group_0": {
        **int_config(4, 128, True)["config_groups"]["group_0"], "format": "marlin-24"}}},
     r"group_0\.format: 'marlin-24' for int weights is not supported; accepted: pack-quantized"),
    ({**int_config(8, 128, True), "config_groups": {"group_0": {
        **int_config(8, 128, True)["config_groups"]["group_0"],
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}},
     r"int weights with quantized activations \(W8A8\) are not supported"),
    ({**int_config(4, 128, True), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, r"kv_cache_scheme is not supported"),
    ({**int_config(4, 128, True), "quantization_status": "frozen"}, r"quantization_status: 'frozen' is not supported"),
])
def test_unsupported_scheme(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        CompressedTensorsConfig.from_config(config)


def test_fused_parts_quantized_differently() -> None:
    config = int_config(4, 128, True)
    config["config_groups"] = {
        "attn_k": {**config["config_groups"]["group_0"], "targets": [r"re:.*k_proj$"]},
        "rest": {**config["config_groups"]["group_0"], "targets": ["Linear"]},
    }
    qcfg = CompressedTensorsConfig.from_config(config)
    with pytest.raises(ModelLoadError, match=r"fuses .*q_proj, .*k_proj, .*v_proj into .*qkv_proj, but the checkpoint "
                                             r"quantizes them differently"):
        qcfg.scheme_for("model.layers.0.self_attn.qkv_proj")
    assert qcfg.scheme_for("model.layers.0.mlp.down_proj") is not None


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM",
                                hidden_size=128, intermediate_size=256)


def _ct(base: str, tmp_path: Any) -> str:
    return write_quantized_checkpoint(base, f"{tmp_path}/ct", f"{tmp_path}/ref", int_config(4, 64, False),
                                      pack_compressed, group_size=64)[0]


def test_weight_shape_mismatch(base: str, tmp_path: Any) -> None:
    path = _ct(base, tmp_path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([128, 512])
    save_file(tensors, file)
    with pytest.raises(ModelLoadError, match=r"down_proj: weight_shape \[\[128, 512\]\] does not match the layer"):
        make_scheduler(path)


def test_dummy_weights_load_and_generate(base: str, tmp_path: Any) -> None:
    path = _ct(base, tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    assert_generates(path, [[5, 6, 7]], 4, load_format="dummy")
