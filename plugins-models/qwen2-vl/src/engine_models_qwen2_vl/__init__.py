"""The Qwen2-VL model plugin: Qwen2-VL and Qwen2.5-VL vision-language models."""

from __future__ import annotations

from engine.hookspecs import ModelSpec, hookimpl


@hookimpl
def register_models(register):  # type: ignore[no-untyped-def]
    register(ModelSpec(
        name="qwen2-vl",
        architectures=("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"),
        factory="engine_models_qwen2_vl.model:model_class_for",
        description="Qwen2-VL and Qwen2.5-VL: images and video over a Qwen2 decoder with M-RoPE",
    ))
