"""Reading PEFT adapter directories: scaling, targets from the weights, refusals naming the field."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import pytest
import torch

from engine.lora.adapter import (
    LoraAdapterError,
    load_adapter,
    parse_adapter_config,
    startup_lora_shape,
)


def test_reads_peft_adapter(llama_ckpt: str, peft_adapter: Callable[..., str]) -> None:
    path = peft_adapter(llama_ckpt, "qv", 8, ["q_proj", "v_proj"], seed=1)
    w = load_adapter("qv", path, torch.float32)
    assert w.config.rank == 8 and w.config.scaling == 2.0  # lora_alpha 16 / r 8
    assert w.config.target_modules == {"q_proj", "v_proj"}
    a, b = w.weights["model.layers.0.self_attn.q_proj"]
    assert a.shape == (8, 64) and b.shape == (64, 8) and bool(b.abs().sum() > 0)
    assert startup_lora_shape({"qv": path}) == (8, {"q_proj", "v_proj"})


def test_rslora_scaling() -> None:
    cfg = parse_adapter_config({"r": 16, "lora_alpha": 8, "use_rslora": True}, "cfg")
    assert math.isclose(cfg.scaling, 8 / 4)
    assert parse_adapter_config({"r": 16, "lora_alpha": 8}, "cfg").scaling == 0.5


@pytest.mark.parametrize("field,value,words", [
    ("use_dora", True, "use_dora True"),
    ("bias", "all", "bias 'all'"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("rank_pattern", {"q_proj": 4}, "rank_pattern"),
    ("r", 0, "r 0"),
    ("peft_type", "IA3", "peft_type 'IA3'"),
])
def test_refuses_what_changes_the_math(field: str, value: object, words: str) -> None:
    with pytest.raises(LoraAdapterError, match=words.replace("[", r"\[")):
        parse_adapter_config({"r": 8, "lora_alpha": 16, field: value}, "adapter_config.json")


def test_refuses_foreign_tensors_and_missing_files(tmp_path, llama_ckpt: str, peft_adapter: Callable[..., str]) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    with pytest.raises(LoraAdapterError, match="no adapter_config.json"):
        load_adapter("x", str(tmp_path), torch.float32)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4}))
    with pytest.raises(LoraAdapterError, match="no adapter_model.safetensors"):
        load_adapter("x", str(tmp_path), torch.float32)
    prefix = "base_model.model.model.layers.0."
    save_file({prefix + "self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
               prefix + "self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
               "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
              os.path.join(tmp_path, "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match="target module 'lm_head'"):
        load_adapter("x", str(tmp_path), torch.float32)
    save_file({prefix + "self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
               prefix + "self_attn.q_proj.lora_B.weight": torch.zeros(64, 2)},
              os.path.join(tmp_path, "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match="do not have rank r=4"):
        load_adapter("x", str(tmp_path), torch.float32)


def test_random_adapter_for_a_config_loads(tmp_path, llama_ckpt: str) -> None:  # type: ignore[no-untyped-def]
    """``write_random_adapter`` (benchmarks on dummy weights) writes what ``load_adapter`` reads."""
    from engine.lora.adapter import write_random_adapter
    from engine.model_executor.checkpoint import load_hf_config

    path = write_random_adapter(load_hf_config(llama_ckpt, False), str(tmp_path / "r"), 4, ["q_proj", "down_proj"])
    w = load_adapter("r", path, torch.float32)
    assert w.config.rank == 4 and w.config.target_modules == {"q_proj", "down_proj"}
    assert w.weights["model.layers.1.mlp.down_proj"][0].shape == (4, 128)
