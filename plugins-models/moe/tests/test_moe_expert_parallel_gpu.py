"""Expert parallelism on two GPUs (NCCL), bf16, CUDA graphs and overlap on: ``--tp-size 2`` with
``--ep-size 2`` (whole experts split across the GPUs) and with ``--ep-size 1`` (every expert split
in two) against transformers.

Qwen2-MoE (routed experts split, a shared expert split by TP, a dense layer) and Qwen3-MoE (top 8
of 16 renormalised, so a token's experts sit on both GPUs). Batch 1 runs the small-batch expert
kernels inside a captured graph; the batch of four prompts runs the grouped kernel. Skipped unless
two CUDA GPUs are visible; run with NCCL_NVLS_ENABLE=0. Greedy outputs must equal transformers' up
to a rounding near-tie (the conformance kit's rule).
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from engine.testing.conformance.model import check_greedy_until_near_tie

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

MAX_NEW = 12
# hidden 256 with head_dim 64: one KV head per GPU at TP=2; expert sizes the kernels' tiles take.
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=2051,
             num_hidden_layers=3)
MODELS = {
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                                              shared_expert_intermediate_size=256, mlp_only_layers=[1],
                                              intermediate_size=512)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=16, num_experts_per_tok=8, moe_intermediate_size=128,
                                              norm_topk_prob=True)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    arch, extra = MODELS[request.param]
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp(f"ep-gpu-{request.param}")), arch, seed=5,
                                **SHAPE, **extra)
    return path, load_hf_model(path, "bfloat16", "cuda")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in (1, 7, 30, 90)]


@pytest.mark.parametrize("ep", [2, 1], ids=["ep2", "ep1"])
def test_two_gpu_experts_match_transformers(model: tuple[str, Any], prompts: list[list[int]], ep: int) -> None:
    from engine import Engine
    from engine.testing.checkpoints import hf_greedy

    path, hf_model = model
    params = {"max_new_tokens": MAX_NEW, "temperature": 0}
    with Engine(model_path=path, tp_size=2, ep_size=ep, attention="triton", dtype="bfloat16",
                max_total_tokens=8192, log_level="warning") as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        single = eng.generate(input_ids=prompts[1], sampling_params=params)  # batch 1: a captured graph
        info = eng.get_server_info()
    assert info["tp_size"] == 2 and info["ep_size"] == ep
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        check_greedy_until_near_tie(hf_model, p, out["output_ids"], hf_greedy(hf_model, p, MAX_NEW), MAX_NEW,
                                    0.1, f"prompt {i} (tp 2, ep {ep}, {os.path.basename(path)})")
    assert single["output_ids"] == outs[1]["output_ids"]
