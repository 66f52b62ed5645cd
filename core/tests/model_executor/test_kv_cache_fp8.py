"""``--kv-cache-dtype fp8_*`` end to end on the CPU: a tiny random Llama through the scheduler.

torch_native always; triton under Triton's interpreter (the root conftest sets TRITON_INTERPRET=1
where no GPU is present). The oracle is the same engine with the KV cache in the activation dtype
(float32 on the CPU). Measured on the tiny Llama (2 layers, 2 KV heads of 16) with these prompts:
last-position logits off by 2.2-2.4% (relative L2) with fp8_e4m3 and 5.3-6.3% with fp8_e5m2;
triton and torch_native agree to 1e-6. Greedy outputs equal the float32-KV ones with fp8_e4m3;
with fp8_e5m2 (two mantissa bits) the first token already differs on these near-tie logits, so
only its logits are checked.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engine.testing.harness import OutputCollector, generate_greedy, last_position_logits, make_scheduler, submit

PROMPTS = [[5, 17, 99, 300, 12, 7, 64, 1000, 33] * 3, [5, 17, 99, 300, 12, 7] * 3]
# Relative L2 error of the last-position logits against the float32-KV engine (measured: see above).
LOGITS_RTOL = {"fp8_e4m3": 0.05, "fp8_e5m2": 0.10}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


BACKENDS = ["torch_native", pytest.param("triton", marks=pytest.mark.skipif(
    not _interpreting(), reason="triton runs on the CPU only under TRITON_INTERPRET=1"))]


def _scheduler(path: str, **kw: Any) -> Any:
    return make_scheduler(path, max_total_tokens=2048, **kw)


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


@pytest.fixture(scope="module")
def reference(llama_ckpt: str) -> dict[str, Any]:
    """The float32-KV engine's logits and greedy outputs (torch_native)."""
    logits = last_position_logits(_scheduler(llama_ckpt), PROMPTS)
    greedy = generate_greedy(_scheduler(llama_ckpt), PROMPTS, 8)
    return {"logits": logits, "greedy": greedy}


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_logits_close_to_float32_kv(llama_ckpt: str, reference: dict[str, Any], attention: str, kind: str) -> None:
    scheduler = _scheduler(llama_ckpt, attention=attention, kv_cache_dtype=kind)
    pool = scheduler.runner.token_to_kv_pool
    assert pool.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kind]
    logits = last_position_logits(scheduler, PROMPTS)
    rel = _rel(logits, reference["logits"])
    assert bool((rel <= LOGITS_RTOL[kind]).all()), f"relative L2 error per prompt {rel.tolist()}"
    assert bool((rel > 0).all()), "fp8 KV gave the float32 logits exactly: is the pool really fp8?"


def test_triton_matches_torch_native_with_fp8_kv(llama_ckpt: str) -> None:
    if not _interpreting():
        pytest.skip("triton runs on the CPU only under TRITON_INTERPRET=1")
    native = last_position_logits(_scheduler(llama_ckpt, kv_cache_dtype="fp8_e4m3"), PROMPTS)
    triton = last_position_logits(_scheduler(llama_ckpt, attention="triton", kv_cache_dtype="fp8_e4m3"), PROMPTS)
    assert bool((_rel(triton, native) <= 1e-4).all()), _rel(triton, native).tolist()


@pytest.mark.parametrize("attention", BACKENDS)
def test_greedy_equal_to_float32_kv(llama_ckpt: str, reference: dict[str, Any], attention: str) -> None:
    out = generate_greedy(_scheduler(llama_ckpt, attention=attention, kv_cache_dtype="fp8_e4m3"), PROMPTS, 8)
    assert out == reference["greedy"]


@pytest.mark.parametrize("attention", BACKENDS)
def test_radix_cache_hit_and_chunked_prefill(llama_ckpt: str, attention: str) -> None:
    """A second request over a cached fp8 prefix, and a prompt prefilled in chunks, decode as
    the same requests do with neither (the cached KV is the same quantized values)."""
    base = PROMPTS[0]
    follow = base + [44, 45, 46, 47]
    plain = _scheduler(llama_ckpt, attention=attention, kv_cache_dtype="fp8_e4m3", disable_radix_cache=True,
                       chunked_prefill_size=-1)
    want = generate_greedy(plain, [base, follow], 6)

    cached = _scheduler(llama_ckpt, attention=attention, kv_cache_dtype="fp8_e4m3", chunked_prefill_size=8)
    col = OutputCollector()
    sp = {"max_new_tokens": 6, "temperature": 0.0}
    first = submit(cached, base, sp)
    while cached.step():
        col.collect(cached)
    col.collect(cached)
    second = submit(cached, follow, sp)
    while cached.step():
        col.collect(cached)
    col.collect(cached)
    assert col.meta[second]["cached_tokens"] >= len(base), col.meta[second]
    assert [col.ids[first], col.ids[second]] == want


def test_pool_holds_twice_the_tokens_per_byte(llama_ckpt: str) -> None:
    auto = _scheduler(llama_ckpt, dtype="bfloat16").runner.token_to_kv_pool
    fp8 = _scheduler(llama_ckpt, dtype="bfloat16", kv_cache_dtype="fp8_e4m3").runner.token_to_kv_pool
    assert auto.bytes_per_token() == 2 * fp8.bytes_per_token()
    assert fp8.k_buffer[0].element_size() == 1


def test_invalid_kv_cache_dtype_is_one_clear_error(llama_ckpt: str) -> None:
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--kv-cache-dtype: invalid value 'fp8'; accepted: auto, fp8_e4m3, fp8_e5m2"):
        _scheduler(llama_ckpt, kv_cache_dtype="fp8")


# Per-layer scales written into the checkpoint: layer 0 under llm-compressor's names
# (self_attn.k_scale / v_scale), layer 1 under AutoFP8's (k_proj / v_proj output_scale).
def _kv_scale_names(layer: int) -> tuple[str, str]:
    prefix = f"model.layers.{layer}.self_attn"
    if layer == 0:
        return f"{prefix}.k_scale", f"{prefix}.v_scale"
    return f"{prefix}.k_proj.output_scale", f"{prefix}.v_proj.output_scale"


def _checkpoint_with_kv_scales(src: str, dst: str, k_scale: float, v_scale: float) -> str:
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = {}
    for layer in range(2):
        k_name, v_name = _kv_scale_names(layer)
        tensors[k_name] = torch.tensor(k_scale * (1 + layer), dtype=torch.float32)
        tensors[v_name] = torch.tensor([v_scale * (1 + layer)], dtype=torch.float32)  # [] and [1] both occur
    save_file(tensors, os.path.join(dst, "kv_scales.safetensors"))
    return dst


def _attention_layers(scheduler: Any) -> list[Any]:
    from engine.layers.radix_attention import RadixAttention

    return [m for m in scheduler.runner.model.modules() if isinstance(m, RadixAttention)]


@pytest.mark.parametrize("attention", BACKENDS)
def test_checkpoint_kv_scales_are_loaded_and_used(llama_ckpt: str, reference: dict[str, Any], attention: str,
                                                  tmp_path: Any) -> None:
    """Scales as a calibrated checkpoint has them (K and V of this model reach 1.3-1.8, so amax / 448
    is about 0.004) keep the logits close (measured 2.7% relative L2, 2.2-2.4% with scales of 1.0);
    scales 80x smaller saturate most K/V in the pool and move the logits far (measured 120-133%):
    so the scales are applied, on the write and on the read alike."""
    calibrated = _checkpoint_with_kv_scales(llama_ckpt, str(tmp_path / "calibrated"), 0.004, 0.0045)
    scheduler = _scheduler(calibrated, attention=attention, kv_cache_dtype="fp8_e4m3")
    layers = _attention_layers(scheduler)
    assert [s for m in layers for s in (m.k_scale, m.v_scale)] == pytest.approx([0.004, 0.0045, 0.008, 0.009])
    rel = _rel(last_position_logits(scheduler, PROMPTS), reference["logits"])
    assert bool((rel <= LOGITS_RTOL["fp8_e4m3"]).all()), f"calibrated scales: relative L2 error {rel.tolist()}"

    saturating = _checkpoint_with_kv_scales(llama_ckpt, str(tmp_path / "saturating"), 5e-5, 6e-5)
    rel = _rel(last_position_logits(_scheduler(saturating, attention=attention, kv_cache_dtype="fp8_e4m3"), PROMPTS),
               reference["logits"])
    assert bool((rel > 0.2).all()), f"scales that saturate the pool left the logits close ({rel.tolist()}): ignored?"


def test_checkpoint_kv_scales_are_harmless_without_fp8_kv(llama_ckpt: str, reference: dict[str, Any],
                                                          tmp_path: Any) -> None:
    """With the KV cache in the activation dtype the scales load and change nothing."""
    path = _checkpoint_with_kv_scales(llama_ckpt, str(tmp_path / "ckpt"), 5e-5, 6e-5)
    scheduler = _scheduler(path)
    assert _attention_layers(scheduler)[0].k_scale == pytest.approx(5e-5)
    assert torch.equal(last_position_logits(scheduler, PROMPTS), reference["logits"])


def test_bad_checkpoint_kv_scale_is_one_clear_error(llama_ckpt: str, tmp_path: Any) -> None:
    from engine.errors import ModelLoadError

    path = _checkpoint_with_kv_scales(llama_ckpt, str(tmp_path / "ckpt"), -1.0, 0.01)
    with pytest.raises(ModelLoadError, match=r"layer 0: k_scale is -1.0; accepted: a finite number > 0"):
        _scheduler(path, kv_cache_dtype="fp8_e4m3")
