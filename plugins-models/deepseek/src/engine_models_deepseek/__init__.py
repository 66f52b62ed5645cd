"""The DeepSeek model plugin: DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, grouped
top-k mixture of experts with shared experts)."""

from __future__ import annotations

from engine.hookspecs import ModelSpec, hookimpl


@hookimpl
def register_models(register):  # type: ignore[no-untyped-def]
    register(ModelSpec(
        name="deepseek",
        architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
        factory="engine_models_deepseek.models:model_class_for",
        description="DeepSeek-V2/V3: multi-head latent attention (latent KV cache) and grouped top-k MoE",
    ))
