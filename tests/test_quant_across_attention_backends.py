"""Issue 12: a quantized model's greedy output does not depend on the attention backend.

Every on-the-fly method (and the FP8 KV cache), and AWQ, GPTQ (act-order) and GGUF Q4_K
checkpoints, run a tiny random Llama on the CPU with the torch-native backend and with the triton
backend (its kernels under Triton's interpreter, see
conftest.py); the generated ids must be the same. The GPU versions of this check (and CUDA graphs
on and off) live in each quant plugin's GPU tests.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.testing.harness import generate_greedy, make_scheduler

pytestmark = pytest.mark.slow

PROMPTS_SEED = 5


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(PROMPTS_SEED)
    return [[rng.randrange(4, 2000) for _ in range(n)] for n in (3, 11, 20)]


def _run(ckpt: str, prompts: list[list[int]], attention: str, **kw: Any) -> list[list[int]]:
    scheduler = make_scheduler(ckpt, attention=attention, max_total_tokens=1024, dtype="float32", **kw)
    assert scheduler.runner.attention_backend_name == attention
    if kw.get("kv_cache_dtype"):
        assert scheduler.runner.token_to_kv_pool.k_buffer[0].element_size() == 1
    return generate_greedy(scheduler, prompts, 6)


@pytest.mark.parametrize("settings", [
    {"quant": "fp8"},
    {"quant": "w8a8_int8"},
    {"kv_cache_dtype": "fp8_e4m3"},
    {"quant": "fp8", "kv_cache_dtype": "fp8_e4m3"},
], ids=["fp8", "w8a8_int8", "kv_fp8", "fp8+kv_fp8"])
def test_greedy_output_is_the_same_with_torch_native_and_triton(llama_tiny: str, prompts: list[list[int]],
                                                                settings: dict[str, str]) -> None:
    if settings.get("quant"):
        pytest.importorskip({"fp8": "engine_quant_fp8", "w8a8_int8": "engine_quant_int8"}[settings["quant"]])
    pytest.importorskip("triton")
    reference = _run(llama_tiny, prompts, "torch_native", **settings)
    assert all(len(ids) == 6 for ids in reference)
    assert _run(llama_tiny, prompts, "triton", **settings) == reference


@pytest.fixture(scope="module")
def llama_tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    # Input sizes 256 and 512: multiples of the 4-bit group sizes and of the K-quants' 256.
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM", hidden_size=256,
                                intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def _awq_checkpoint(base: str, tmp: Any) -> str:
    pytest.importorskip("engine_quant_awq")
    from engine_quant_awq.format import pack_awq
    from engine_quant_wna16.checkpoints import write_quantized_checkpoint

    config = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    return write_quantized_checkpoint(base, f"{tmp}/awq", f"{tmp}/ref", config, pack_awq, group_size=64)[0]


def _gptq_checkpoint(base: str, tmp: Any) -> str:
    pytest.importorskip("engine_quant_gptq")
    from engine_quant_gptq.format import pack_gptq
    from engine_quant_wna16.checkpoints import write_quantized_checkpoint

    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True}
    return write_quantized_checkpoint(base, f"{tmp}/gptq", f"{tmp}/ref", config, pack_gptq, group_size=32,
                                      act_order=True)[0]


def _gguf_checkpoint(base: str, tmp: Any) -> str:
    pytest.importorskip("engine_quant_gguf")
    from engine.model_executor.checkpoint import resolve_checkpoint
    from engine.testing.checkpoints import load_hf_model
    from engine.testing.gguf_files import write_tiny_gguf

    path = f"{tmp}/tiny-Q4_K.gguf"
    write_tiny_gguf(path, load_hf_model(base), "Q4_K")
    return resolve_checkpoint(path, weights=False)


@pytest.mark.parametrize("make", [_awq_checkpoint, _gptq_checkpoint, _gguf_checkpoint], ids=["awq", "gptq", "gguf-Q4_K"])
def test_pre_quantized_checkpoints_too(llama_tiny: str, prompts: list[list[int]], tmp_path: Any,
                                       monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = make(llama_tiny, tmp_path)
    settings = {"quant": "gguf"} if make is _gguf_checkpoint else {}
    reference = _run(ckpt, prompts, "torch_native", **settings)
    assert _run(ckpt, prompts, "triton", **settings) == reference
