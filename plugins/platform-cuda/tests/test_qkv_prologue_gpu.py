"""The fused decode prologue in the engine (GPU only): greedy decoding of tiny models is the same
token for token with ``cuda.qkv_prologue`` on (the default) and off, with CUDA graphs, for Llama
(no q/k norm), Qwen3 (q/k norm, head_dim 128), Mistral (sliding window), Qwen3-MoE (attention
inherited from the Llama plugin), the triton, flashinfer and torch_native backends, and an fp8
KV cache. The kernel must actually run in the "on" engines and never in the "off" ones.
"""

from __future__ import annotations

import gc
import importlib.util
from typing import Any

import pytest
import torch

from engine.layers.radix_attention import RadixAttention
from engine.testing.harness import generate_greedy, make_scheduler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [list(range(5, 10)), list(range(300, 317)), list(range(1000, 1040))]
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=512)),
    "qwen3": ("Qwen3ForCausalLM", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=128, intermediate_size=512)),
    "mistral": ("MistralForCausalLM", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=512, sliding_window=16)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=128, **_MOE)),
}
_FLASHINFER = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")
CASES = [
    pytest.param("llama", "triton", "auto", True),
    pytest.param("llama", "flashinfer", "auto", True, marks=_FLASHINFER),
    pytest.param("qwen3", "triton", "auto", True),
    pytest.param("qwen3", "triton", "fp8_e4m3", True),
    pytest.param("qwen3", "flashinfer", "fp8_e4m3", True, marks=_FLASHINFER),
    pytest.param("qwen3", "torch_native", "auto", False),
    pytest.param("mistral", "triton", "auto", True),
    pytest.param("qwen3_moe", "triton", "auto", True),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return {name: make_tiny_checkpoint(str(tmp_path_factory.mktemp(name)), arch, dtype="bfloat16", seed=7, **cfg)
            for name, (arch, cfg) in MODELS.items()}


def _greedy(path: str, on: bool, attention: str, kv: str, graphs: bool,
            monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], int]:
    """Greedy outputs and how often the fused kernel ran (capture included)."""
    import engine_platform_cuda.prologue as prologue

    calls = [0]
    kernel = prologue.qkv_prologue

    def counting(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        kernel(*args, **kwargs)

    monkeypatch.setattr(prologue, "qkv_prologue", counting)  # what layer_kernels() hands out
    sched = make_scheduler(path, platform="cuda", dtype="bfloat16", attention=attention, kv_cache_dtype=kv,
                           disable_cuda_graph=not graphs, cuda_graph_max_bs=4,
                           plugin_options={"cuda": {"qkv_prologue": on}})
    layers = [m for m in sched.runner.model.modules() if isinstance(m, RadixAttention)]
    assert layers and all((m.fused_prologue is not None) == on for m in layers)
    if graphs:
        assert sched.runner.cuda_graph_runner is not None
    out = generate_greedy(sched, PROMPTS, 16, ignore_eos=True)
    del sched
    gc.collect()
    torch.cuda.empty_cache()
    return out, calls[0]


@pytest.mark.parametrize("model,attention,kv,graphs", CASES)
def test_greedy_same_with_and_without_the_fused_prologue(checkpoints: dict[str, str], model: str, attention: str,
                                                         kv: str, graphs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    off, off_calls = _greedy(checkpoints[model], False, attention, kv, graphs, monkeypatch)
    on, on_calls = _greedy(checkpoints[model], True, attention, kv, graphs, monkeypatch)
    assert off_calls == 0 and on_calls > 0
    assert all(len(o) == 16 for o in off)
    assert on == off
