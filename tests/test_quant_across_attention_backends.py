"""Issue 12: a quantized model's greedy output does not depend on the attention backend.

Every on-the-fly method (and the FP8 KV cache) runs a tiny random Llama on the CPU with the
torch-native backend and with the triton backend (its kernels under Triton's interpreter, see
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

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM")
