"""Every architecture of the plugin against Hugging Face transformers (the oracle)."""

from __future__ import annotations

from engine.testing import ModelConformance


class TestLlama(ModelConformance):
    architecture = "LlamaForCausalLM"


class TestLlamaPagedChunked(ModelConformance):
    # Same oracle with page size 4 and small prefill chunks.
    architecture = "LlamaForCausalLM"
    server_args = {"page_size": 4, "chunked_prefill_size": 16}


class TestMistral(ModelConformance):
    architecture = "MistralForCausalLM"


class TestQwen2(ModelConformance):
    architecture = "Qwen2ForCausalLM"


class TestQwen3(ModelConformance):
    architecture = "Qwen3ForCausalLM"
