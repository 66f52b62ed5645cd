"""The Llama-family model plugin: Llama, Mistral, Qwen2 and Qwen3 decoder-only models."""

from __future__ import annotations

from engine.hookspecs import ModelSpec, hookimpl


@hookimpl
def register_models(register):  # type: ignore[no-untyped-def]
    register(ModelSpec(
        name="llama",
        architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
        factory="engine_models_llama.llama:model_class_for",
        description="Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 dense decoders",
    ))
    register(ModelSpec(
        name="llama-classification",
        architectures=("LlamaForSequenceClassification", "MistralForSequenceClassification",
                       "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification"),
        factory="engine_models_llama.classification:model_class_for",
        description="sequence classification and reward heads (num_labels=1) over the same decoders",
    ))
