"""Every architecture of the plugin against Hugging Face transformers (the oracle)."""

from __future__ import annotations

import pytest

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


# -- the CUDA path (bf16, as users run it); skipped without a GPU ------------------------------
@pytest.mark.gpu
class _Cuda(ModelConformance):
    device = "cuda"
    dtype = "bfloat16"
    logits_atol = 0.1  # bf16 activations through different kernels than transformers'


class TestLlamaCudaTriton(_Cuda):
    architecture = "LlamaForCausalLM"
    server_args = {"attention": "triton"}


class TestLlamaCudaTritonNoGraph(_Cuda):
    architecture = "LlamaForCausalLM"
    server_args = {"attention": "triton", "disable_cuda_graph": True}


class TestQwen3CudaTritonPaged(_Cuda):
    architecture = "Qwen3ForCausalLM"
    server_args = {"attention": "triton", "page_size": 16, "chunked_prefill_size": 32}


class TestMistralCudaTorchNative(_Cuda):
    architecture = "MistralForCausalLM"
    server_args = {"attention": "torch_native"}


class TestLlamaBf16Cpu(ModelConformance):
    # bf16 on the CPU: greedy tokens must agree until a rounding near-tie (see tie_tolerance).
    architecture = "LlamaForCausalLM"
    dtype = "bfloat16"
    logits_atol = 0.1


class TestLlamaCudaTritonHeadDim128(_Cuda):
    # Llama-3-like head size, so the fused kernels and attention run their real tile shapes.
    architecture = "LlamaForCausalLM"
    config_overrides = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}
    server_args = {"attention": "triton"}


class TestLlamaCudaFlashinfer(_Cuda):
    architecture = "LlamaForCausalLM"
    config_overrides = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64}
    server_args = {"attention": "flashinfer"}
