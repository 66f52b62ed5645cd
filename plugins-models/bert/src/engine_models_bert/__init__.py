"""The BERT encoder model plugin: sentence-transformers' embedding models (all-MiniLM, bge, e5...)."""

from __future__ import annotations

from engine.hookspecs import ModelSpec, hookimpl


@hookimpl
def register_models(register):  # type: ignore[no-untyped-def]
    register(ModelSpec(
        name="bert",
        architectures=("BertModel", "BertForMaskedLM"),
        factory="engine_models_bert.bert:model_class_for",
        description="BERT encoders (bidirectional, no KV cache) for --task embed",
    ))
    register(ModelSpec(
        name="bert-classification",
        architectures=("BertForSequenceClassification",),
        factory="engine_models_bert.classification:model_class_for",
        description="BERT cross-encoders and classifiers (pooler + classifier over [CLS]) for --task score",
    ))
