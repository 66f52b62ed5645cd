"""``w8a8_int8`` through the whole engine on a tiny Llama: ``--quant w8a8_int8`` and an int8 checkpoint.

Bar: at the last position of every prompt, the quantized model's logits have cosine
similarity > 0.99 with the unquantized model's, and generation produces exactly
``max_new_tokens`` tokens. Measured on CPU (float32): cosine 0.9996-0.9998, relative L2
logit error 0.019-0.029, greedy argmax unchanged.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.testing.harness import assert_cosine_close, assert_generates, last_position_logits, make_scheduler
from engine_quant_int8.quantize import quantize_per_channel
from safetensors.torch import load_file, save_file

MIN_COSINE = 0.99
MAX_NEW_TOKENS = 12
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama_int8")), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in (5, 17, 33)]


@pytest.fixture(scope="module")
def reference_logits(checkpoint: str, prompts: list[list[int]]) -> torch.Tensor:
    return last_position_logits(make_scheduler(checkpoint), prompts)


def _assert_close_to_reference(logits: torch.Tensor, reference: torch.Tensor) -> None:
    assert_cosine_close(logits, reference, MIN_COSINE)


def _assert_generates(path: str, prompts: list[list[int]], **server_args: object) -> None:
    assert_generates(path, prompts, MAX_NEW_TOKENS, **server_args)


def _write_int8_checkpoint(src: str, dst: str) -> str:
    """SGLang's layout: int8 ``weight [out, in]`` + float32 ``weight_scale [out, 1]`` per projection."""
    os.makedirs(dst, exist_ok=True)
    tensors = {}
    for name, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in _PROJECTIONS:
            q, scale = quantize_per_channel(tensor)
            tensors[name], tensors[f"{module}.weight_scale"] = q, scale[:, None].contiguous()
        else:
            tensors[name] = tensor
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "w8a8_int8"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(src):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(src, name), dst)
    return dst


def test_on_the_fly_int8(checkpoint: str, prompts: list[list[int]], reference_logits: torch.Tensor) -> None:
    scheduler = make_scheduler(checkpoint, quant="w8a8_int8")
    layer = scheduler.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.int8
    assert layer.mlp.gate_up_proj.weight_scale.shape == (2 * 128,)  # per output channel
    _assert_close_to_reference(last_position_logits(scheduler, prompts), reference_logits)
    _assert_generates(checkpoint, prompts, quant="w8a8_int8")


def test_int8_checkpoint(checkpoint: str, prompts: list[list[int]], reference_logits: torch.Tensor,
                         tmp_path: object) -> None:
    path = _write_int8_checkpoint(checkpoint, str(tmp_path))
    logits = last_position_logits(make_scheduler(path), prompts)  # the quant method comes from config.json
    # Same quantizer, so a serialized checkpoint and on-the-fly quantization agree exactly.
    assert torch.equal(logits, last_position_logits(make_scheduler(checkpoint, quant="w8a8_int8"), prompts))
    _assert_close_to_reference(logits, reference_logits)
    _assert_generates(path, prompts)
