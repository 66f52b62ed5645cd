"""The LLaVA model plugin: LlavaForConditionalGeneration (CLIP or SigLIP vision tower, projector,
Llama-family decoder) served with images through ``engine.multimodal``."""

from __future__ import annotations

from engine.hookspecs import ModelSpec, hookimpl


@hookimpl
def register_models(register):  # type: ignore[no-untyped-def]
    register(ModelSpec(
        name="llava",
        architectures=("LlavaForConditionalGeneration",),
        factory="engine_models_llava.llava:model_class_for",
        description="LLaVA 1.5-style vision-language models (CLIP/SigLIP tower + MLP projector + Llama-family decoder)",
    ))
