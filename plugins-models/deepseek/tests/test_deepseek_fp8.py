"""DeepSeek-V3's block-wise FP8 checkpoint format (``weight_block_size``, ``weight_scale_inv``)
through the fp8 quant plugin, experts included, on the CPU reference path.

Every projection of a tiny V3 (MLA's, the dense MLP's, the routed and shared experts') is
block-quantized with 16 x 16 tiles (the tiny shapes are multiples of 16, as real ones are of 128).
The exact oracle is a float32 checkpoint holding the dequantized weights: logits must agree to
1e-4 and greedy tokens exactly (MLA's absorbed W_UK/W_UV come out of the fp8 ``kv_b_proj``).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.layers.moe import FusedMoE
from engine.testing.checkpoints import copy_tokenizer, tiny_config
from engine.testing.harness import generate_greedy, last_position_logits, make_scheduler
from engine_quant_fp8.quantize import FP8_DTYPE, dequantize_per_block, quantize_per_block

BLOCK = (16, 16)
SHAPES = dict(vocab_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
              q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=4,
              num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32,
              n_shared_experts=1, max_position_embeddings=256)


def _is_projection(name: str) -> bool:
    return name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    import transformers

    torch.manual_seed(11)
    model = transformers.DeepseekV3ForCausalLM(tiny_config("DeepseekV3ForCausalLM", **SHAPES))
    base = str(tmp_path_factory.mktemp("v3"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    model.save_pretrained(base, safe_serialization=True)
    quant, exact = str(tmp_path_factory.mktemp("v3-fp8")), str(tmp_path_factory.mktemp("v3-deq"))
    q_tensors, d_tensors = {}, {}
    for name, tensor in load_file(os.path.join(base, "model.safetensors")).items():
        if _is_projection(name):
            q, scale = quantize_per_block(tensor, BLOCK)
            q_tensors[name], q_tensors[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
            d_tensors[name] = dequantize_per_block(q, scale, BLOCK, torch.float32)
        else:
            q_tensors[name] = d_tensors[name] = tensor
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    for directory, tensors in ((quant, q_tensors), (exact, d_tensors)):
        save_file(tensors, os.path.join(directory, "model.safetensors"))
        copy_tokenizer(directory)
    shutil.copy(os.path.join(base, "config.json"), exact)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK),
                                     "activation_scheme": "dynamic"}
    with open(os.path.join(quant, "config.json"), "w") as f:
        json.dump(config, f)
    return quant, exact


def test_block_fp8_v3_equals_its_dequantized_weights(checkpoints: tuple[str, str]) -> None:
    quant, exact = checkpoints
    prompts = [[9, 400, 17, 3 + 5, 301], [4 + 13 * i for i in range(30)]]
    ref_sched = make_scheduler(exact, dtype="float32")
    sched = make_scheduler(quant, dtype="float32")
    experts = [m for m in sched.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.w13_weight.dtype == FP8_DTYPE and m.w13_weight_scale_inv.shape == (4, 4, 4)
                           for m in experts)
    attn = sched.runner.model.model.layers[1].self_attn
    assert attn.q_b_proj.weight.dtype == FP8_DTYPE and attn.o_proj.weight.dtype == FP8_DTYPE
    assert not hasattr(attn, "kv_b_proj") and attn.w_uk.dtype == torch.float32  # absorbed, then dropped
    torch.testing.assert_close(last_position_logits(sched, prompts), last_position_logits(ref_sched, prompts),
                               atol=1e-4, rtol=1e-4)
    assert generate_greedy(sched, prompts, 8) == generate_greedy(ref_sched, prompts, 8)
