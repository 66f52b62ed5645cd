"""Every architecture of the plugin against Hugging Face transformers (the oracle), on the CPU.

Tiny checkpoints with 4 experts, top-2: in a prompt of a few tokens some experts get no token,
so the empty-expert path runs too.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from engine.testing import ModelConformance

_EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


class TestMixtral(ModelConformance):
    architecture = "MixtralForCausalLM"
    plugin_name = "moe"
    config_overrides: ClassVar[dict[str, Any]] = {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                  "intermediate_size": 32}


class TestQwen2Moe(ModelConformance):
    # Shared expert with its sigmoid gate; layer 1 dense (mlp_only_layers); top-k not renormalised.
    architecture = "Qwen2MoeForCausalLM"
    plugin_name = "moe"
    config_overrides: ClassVar[dict[str, Any]] = {"num_experts": 4, **_EXPERTS, "shared_expert_intermediate_size": 48,
                                                  "mlp_only_layers": [1], "norm_topk_prob": False}


class TestQwen3Moe(ModelConformance):
    # q/k norm, renormalised top-k.
    architecture = "Qwen3MoeForCausalLM"
    plugin_name = "moe"
    config_overrides: ClassVar[dict[str, Any]] = {"num_experts": 4, **_EXPERTS, "norm_topk_prob": True}


# -- the CUDA path (bf16, the fused Triton kernel); skipped without a GPU -----------------------
@pytest.mark.gpu
class TestQwen3MoeCuda(ModelConformance):
    architecture = "Qwen3MoeForCausalLM"
    config_overrides: ClassVar[dict[str, Any]] = {"num_experts": 8, **_EXPERTS, "norm_topk_prob": True}
    device = "cuda"
    dtype = "bfloat16"
    logits_atol = 0.1
    server_args: ClassVar[dict[str, Any]] = {"attention": "triton"}


@pytest.mark.gpu
class TestMixtralCudaNoGraph(ModelConformance):
    architecture = "MixtralForCausalLM"
    config_overrides: ClassVar[dict[str, Any]] = {"num_local_experts": 8, "num_experts_per_tok": 2,
                                                  "intermediate_size": 32}
    device = "cuda"
    dtype = "bfloat16"
    logits_atol = 0.1
    server_args: ClassVar[dict[str, Any]] = {"attention": "triton", "disable_cuda_graph": True}
