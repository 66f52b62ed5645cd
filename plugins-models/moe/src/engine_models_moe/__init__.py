"""The mixture-of-experts model plugin: Mixtral, Qwen2-MoE and Qwen3-MoE."""

from __future__ import annotations

from engine.hookspecs import ModelSpec, hookimpl


@hookimpl
def register_models(register):  # type: ignore[no-untyped-def]
    register(ModelSpec(
        name="moe",
        architectures=("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
        factory="engine_models_moe.models:model_class_for",
        description="Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE mixture-of-experts decoders",
    ))
