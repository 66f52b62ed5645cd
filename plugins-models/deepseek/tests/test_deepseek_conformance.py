"""The model conformance kit on the DeepSeek plugin (transformers' classes are the oracles)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from engine.testing import ModelConformance

_SHAPES = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=4, num_experts_per_tok=2,
               n_group=2, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32, n_shared_experts=1)


class TestDeepseekV3(ModelConformance):
    architecture = "DeepseekV3ForCausalLM"
    plugin_name = "deepseek"
    config_overrides: ClassVar[dict[str, Any]] = dict(_SHAPES, q_lora_rank=48)
    max_new_tokens = 12

    @pytest.fixture(scope="class")
    @classmethod
    def prompts(cls) -> list[list[int]]:
        return [[11, 400, 1900, 37, 5], [7 + 31 * i for i in range(19)]]
