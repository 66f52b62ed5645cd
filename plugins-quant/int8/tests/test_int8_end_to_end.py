"""``w8a8_int8`` through the whole engine on a tiny Llama: ``--quant w8a8_int8``, an int8 checkpoint
and a static-activation-scale checkpoint, each on both paths of ``gemm.int8_linear``.

``path`` forces the path for every forward (the switch constant moved to 0 or past any batch):
``w8a8`` quantizes activations, ``weight_only`` keeps them in float32. Bar: at the last position
of every prompt the quantized model's logits have cosine similarity > 0.99 with the unquantized
model's and relative L2 error < 0.05, and generation produces exactly ``max_new_tokens`` tokens.
Measured on CPU (float32, 2026-11-23), relative L2 logit error per prompt: w8a8 0.019-0.029
(cosine 0.9996-0.9998), weight-only 0.013-0.021 (cosine 0.9998-0.9999), static w8a8 (scales
calibrated on the same prompts) 0.030-0.039 (cosine 0.9993-0.9996); argmax unchanged in all.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from engine.layers.quantization import FUSED_LAYER_PARTS
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.testing.harness import assert_cosine_close, assert_generates, last_position_logits, make_scheduler
from engine_quant_int8 import gemm
from engine_quant_int8.quantize import INT8_MAX, quantize_per_channel
from safetensors.torch import load_file, save_file

MIN_COSINE = 0.99
MAX_REL_ERROR = 0.05
MAX_NEW_TOKENS = 12
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama_int8")), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in (5, 17, 33)]


@pytest.fixture(params=["w8a8", "weight_only"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every linear of the test takes this path of ``int8_linear``, whatever its batch."""
    monkeypatch.setattr(gemm, "WEIGHT_ONLY_MAX_M", 0 if request.param == "w8a8" else 1 << 30)
    return request.param


@pytest.fixture(scope="module")
def reference_logits(checkpoint: str, prompts: list[list[int]]) -> torch.Tensor:
    return last_position_logits(make_scheduler(checkpoint), prompts)


def _assert_close_to_reference(logits: torch.Tensor, reference: torch.Tensor) -> None:
    assert_cosine_close(logits, reference, MIN_COSINE)
    rel = (logits - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert bool((rel < MAX_REL_ERROR).all()), f"relative L2 logit error per prompt: {rel.tolist()}"


def _assert_generates(path: str, prompts: list[list[int]], **server_args: object) -> None:
    assert_generates(path, prompts, MAX_NEW_TOKENS, **server_args)


def _write_int8_checkpoint(src: str, dst: str, input_scales: dict[str, float] | None = None) -> str:
    """SGLang's layout: int8 ``weight [out, in]`` + float32 ``weight_scale [out, 1]`` per projection;
    with ``input_scales`` (projection module name -> scale) also a static ``input_scale []``."""
    os.makedirs(dst, exist_ok=True)
    tensors = {}
    for name, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in _PROJECTIONS:
            q, scale = quantize_per_channel(tensor)
            tensors[name], tensors[f"{module}.weight_scale"] = q, scale[:, None].contiguous()
            if input_scales is not None:
                tensors[f"{module}.input_scale"] = torch.tensor(input_scales[module], dtype=torch.float32)
        else:
            tensors[name] = tensor
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "w8a8_int8"}
    if input_scales is not None:
        config["quantization_config"]["activation_scheme"] = "static"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(src):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(src, name), dst)
    return dst


def _calibrated_input_scales(checkpoint: str, prompts: list[list[int]]) -> dict[str, float]:
    """``absmax / 127`` of each projection's input over the prompts, from the unquantized model
    (a fused engine layer's input is the input of each checkpoint projection it stacks)."""
    scheduler = make_scheduler(checkpoint)
    absmax: dict[str, float] = {}
    hooks = []
    for name, module in scheduler.runner.model.named_modules():
        parent, _, leaf = name.rpartition(".")
        parts = FUSED_LAYER_PARTS.get(leaf, (leaf,))
        if parts[0] not in _PROJECTIONS:
            continue

        def record(_module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                   keys: tuple[str, ...] = tuple(f"{parent}.{part}" for part in parts)) -> None:
            for key in keys:
                absmax[key] = max(absmax.get(key, 0.0), float(args[0].abs().max()))

        hooks.append(module.register_forward_pre_hook(record))
    last_position_logits(scheduler, prompts)
    for hook in hooks:
        hook.remove()
    return {key: value / INT8_MAX for key, value in absmax.items()}


def test_on_the_fly_int8(checkpoint: str, prompts: list[list[int]], reference_logits: torch.Tensor,
                         path: str) -> None:
    scheduler = make_scheduler(checkpoint, quant="w8a8_int8")
    layer = scheduler.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.int8
    assert layer.mlp.gate_up_proj.weight_scale.shape == (2 * 128,)  # per output channel
    _assert_close_to_reference(last_position_logits(scheduler, prompts), reference_logits)
    _assert_generates(checkpoint, prompts, quant="w8a8_int8")


def test_int8_checkpoint(checkpoint: str, prompts: list[list[int]], reference_logits: torch.Tensor,
                         tmp_path: object, path: str) -> None:
    path = _write_int8_checkpoint(checkpoint, str(tmp_path))
    logits = last_position_logits(make_scheduler(path), prompts)  # the quant method comes from config.json
    # Same quantizer, so a serialized checkpoint and on-the-fly quantization agree exactly.
    assert torch.equal(logits, last_position_logits(make_scheduler(checkpoint, quant="w8a8_int8"), prompts))
    _assert_close_to_reference(logits, reference_logits)
    _assert_generates(path, prompts)


def test_static_activation_scale_checkpoint(checkpoint: str, prompts: list[list[int]],
                                            reference_logits: torch.Tensor, tmp_path: object, path: str) -> None:
    path_dir = _write_int8_checkpoint(checkpoint, str(tmp_path), _calibrated_input_scales(checkpoint, prompts))
    scheduler = make_scheduler(path_dir)
    qkv = scheduler.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.input_scale.shape == (1,)  # q/k/v's scales reduced to their max
    logits = last_position_logits(scheduler, prompts)
    _assert_close_to_reference(logits, reference_logits)
    if path == "weight_only":  # activations are not quantized: the static scales play no part
        assert torch.equal(logits, last_position_logits(make_scheduler(checkpoint, quant="w8a8_int8"), prompts))
    _assert_generates(path_dir, prompts)
