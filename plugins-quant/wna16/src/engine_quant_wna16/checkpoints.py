"""Pre-quantized copies of a tiny Hugging Face checkpoint, for the formats' end-to-end tests.

``write_quantized_checkpoint`` quantizes every linear projection of a checkpoint with
``quantize_rtn`` and writes two directories: the quantized checkpoint in a format's layout
(``serialize`` turns one ``IntWeight`` into that format's tensors) with its
``quantization_config``, and the same model with each projection replaced by its dequantized
float32 weight: the reference that a correct loader must reproduce up to float rounding.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zlib
from collections.abc import Callable
from typing import Any

import torch

from engine_quant_wna16.layout import IntWeight
from engine_quant_wna16.rtn import act_order_g_idx, quantize_rtn

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Inputs shared by fused projections: one act-order per input, as GPTQ's shared Hessian gives.
_INPUT_OF = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "gate_proj": "mlp_in", "up_proj": "mlp_in"}


def make_base_checkpoint(directory: str) -> str:
    """The tiny random Llama the formats' tests quantize: hidden 128 and intermediate 256, so every
    input size is a multiple of each group size (32-128)."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(directory, "LlamaForCausalLM", hidden_size=128, intermediate_size=256)


def random_prompts(seed: int) -> list[list[int]]:
    """Two prompts (5 and 19 tokens) of ids drawn with ``seed``."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in (5, 19)]


def write_quantized_checkpoint(src: str, dst: str, ref_dst: str, quantization_config: dict[str, Any],
                               serialize: Callable[[IntWeight], dict[str, torch.Tensor]], *, bits: int = 4,
                               group_size: int = 128, symmetric: bool = False, act_order: bool = False,
                               skip: tuple[str, ...] = ()) -> tuple[str, str]:
    """Writes ``dst`` (quantized) and ``ref_dst`` (dequantized float32) from checkpoint ``src``.

    Args:
        serialize: the format's packer for one projection.
        skip: full projection names left in float (the config's ignore list should name them).
    Returns:
        ``(dst, ref_dst)``.
    """
    from safetensors.torch import load_file, save_file

    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        leaf = module.rsplit(".", 1)[-1]
        if not name.endswith(".weight") or leaf not in PROJECTIONS or module in skip:
            quantized[name] = reference[name] = tensor
            continue
        k = tensor.shape[1]
        group = k if group_size == -1 else group_size
        g_idx = None
        if act_order:
            layer = module.rsplit(".", 2)[0]
            seed = zlib.crc32(f"{layer}/{_INPUT_OF.get(leaf, leaf)}".encode())
            g_idx = act_order_g_idx(k, group, seed)
        w = quantize_rtn(tensor, bits, group_size, symmetric, g_idx)
        for key, value in serialize(w).items():
            quantized[f"{module}.{key}"] = value
        reference[name] = w.dequantize()
    for directory, tensors, qcfg in ((dst, quantized, quantization_config), (ref_dst, reference, None)):
        os.makedirs(directory, exist_ok=True)
        save_file(tensors, os.path.join(directory, "model.safetensors"))
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        if qcfg is not None:
            config["quantization_config"] = qcfg
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for entry in os.listdir(src):
            if entry.startswith("tokenizer"):
                shutil.copy(os.path.join(src, entry), directory)
    return dst, ref_dst


def compare_with_reference(quantized: str, reference: str, prompts: list[list[int]], max_new_tokens: int,
                           **server_args: Any) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """Serves both checkpoints with the engine (CPU): per prompt, the relative L2 error of the
    quantized model's last-position logits against the reference's, and both greedy outputs."""
    from engine.testing.harness import generate_greedy, last_position_logits, make_scheduler

    got = last_position_logits(make_scheduler(quantized, **server_args), prompts)
    want = last_position_logits(make_scheduler(reference, **server_args), prompts)
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    out_q = generate_greedy(make_scheduler(quantized, **server_args), prompts, max_new_tokens, ignore_eos=True)
    out_r = generate_greedy(make_scheduler(reference, **server_args), prompts, max_new_tokens, ignore_eos=True)
    return rel, out_q, out_r
