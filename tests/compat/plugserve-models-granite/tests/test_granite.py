"""The conformance kit against the Granite model: transformers' GraniteForCausalLM is the reference."""

from __future__ import annotations

from engine.testing import ModelConformance


class TestGranite(ModelConformance):
    architecture = "GraniteForCausalLM"
    # Multipliers away from 1, so a model that ignored one of them would not match.
    config_overrides = {"embedding_multiplier": 2.0, "attention_multiplier": 0.125,
                        "residual_multiplier": 0.5, "logits_scaling": 4.0}
    max_new_tokens = 8
