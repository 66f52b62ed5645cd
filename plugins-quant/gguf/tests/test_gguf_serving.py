"""``--quant gguf`` end to end on tiny GGUF files (no downloads), against the dequantized path.

Files are written by ``engine.testing.gguf_files``: Q4_0, Q4_1 and Q8_0 quantized from a tiny
Llama by gguf's own quantizers, Q4_K and Q6_K as random well-formed blocks (gguf has no
K-quantizer), each cross-checked by gguf's dequantizer there. On the CPU the kept-quantized path
dequantizes the same blocks bit-identically before ``F.linear``, so the measured logit difference
to the dequantized path is 0.0 on every file (bar 1e-4, for a BLAS that orders sums differently);
greedy tokens are equal.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
from typing import Any

import pytest
import torch
from engine.errors import ModelLoadError
from engine.model_executor.checkpoint import resolve_checkpoint
from engine.testing import QuantMethodConformance
from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint
from engine.testing.gguf_files import write_tiny_gguf
from engine.testing.harness import generate_greedy, last_position_logits, make_scheduler
from engine_quant_gguf import formats

SHAPES = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100], [42]]
LOGITS_ATOL = 1e-4


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    ckpt = make_tiny_checkpoint(str(tmp_path_factory.mktemp("hf")), "LlamaForCausalLM", **SHAPES)
    return ckpt, load_hf_model(ckpt)


def _converted(tmp: pathlib.Path, model: Any, qtype: str, **kw: Any) -> str:
    path = str(tmp / f"tiny-{qtype}.gguf")
    write_tiny_gguf(path, model, qtype, **kw)
    return resolve_checkpoint(path)


def _compare(converted: str) -> Any:
    plain = make_scheduler(converted)
    kept = make_scheduler(converted, quant="gguf")
    diff = (last_position_logits(plain, PROMPTS) - last_position_logits(kept, PROMPTS)).abs().max().item()
    assert diff <= LOGITS_ATOL, diff
    assert generate_greedy(make_scheduler(converted, quant="gguf"), PROMPTS, 12) == \
        generate_greedy(make_scheduler(converted), PROMPTS, 12)
    return kept


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_kept_blocks_serve_like_the_dequantized_model(tmp_path: pathlib.Path, source: tuple[str, Any],
                                                      qtype: str) -> None:
    kept = _compare(_converted(tmp_path, source[1], qtype))
    layer = kept.runner.model.model.layers[0].self_attn.qkv_proj
    (segment,) = layer.gguf_segments  # one type: one block tensor, one kernel
    assert segment[0] == int(getattr(formats, qtype))
    assert layer.weight.dtype == torch.uint8
    assert layer.weight.shape == (256 + 2 * 128, formats.row_bytes(segment[0], 256))


def test_mixed_types_in_one_fused_layer(tmp_path: pathlib.Path, source: tuple[str, Any],
                                        caplog: pytest.LogCaptureFixture) -> None:
    """Q4_K_M-like: Q4_K everywhere but v_proj and down_proj (Q6_K), gate_proj in Q5_0 (no kernel:
    dequantized at load) and up_proj in F16."""
    caplog.set_level(logging.INFO)
    converted = _converted(tmp_path, source[1], "Q4_K",
                           overrides={"v_proj": "Q6_K", "down_proj": "Q6_K", "gate_proj": "Q5_0", "up_proj": "F16"})
    kept = _compare(converted)
    layers = kept.runner.model.model.layers[0]
    qkv = layers.self_attn.qkv_proj
    assert [(t, first, n) for t, first, n, _ in qkv.gguf_segments] == [(formats.Q4_K, 0, 384), (formats.Q6_K, 384, 128)]
    assert qkv.weight_0.dtype == qkv.weight_1.dtype == torch.uint8
    gate_up = layers.mlp.gate_up_proj  # both float after loading: one dense weight, F.linear
    assert [(t, n) for t, _, n, _ in gate_up.gguf_segments] == [(None, 1024)]
    assert gate_up.weight.dtype == torch.float32
    assert layers.mlp.down_proj.gguf_segments[0][0] == formats.Q6_K
    assert "GGUF type Q5_0 has no kernel here; dequantized at load" in caplog.text
    report = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("gguf: linear weights kept"))
    assert "Q4_K" in report and "Q6_K" in report and "held dequantized" in report


def test_memory_report_compares_blocks_with_dequantized_bytes(tmp_path: pathlib.Path, source: tuple[str, Any],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    sched = make_scheduler(_converted(tmp_path, source[1], "Q8_0"), quant="gguf")
    config = sched.runner.selection.quant_config
    # 2 layers x (qkv 512 + o 256 + gate_up 1024 + down 256 rows... ) x 256 inputs
    linear_elems = sum(m.weight.shape[0] * m.gguf_in_features for m in sched.runner.model.modules()
                       if hasattr(m, "gguf_segments"))
    assert config.kept_bytes[formats.Q8_0] == linear_elems * 34 // 32
    assert config.dequantized_bytes == linear_elems * 4  # float32 on the CPU
    assert any("dequantized they would take" in r.getMessage() for r in caplog.records)


def test_quant_gguf_on_a_safetensors_checkpoint_is_refused(source: tuple[str, Any]) -> None:
    with pytest.raises(ModelLoadError, match=r"--quant gguf: .* is not a GGUF checkpoint; accepted: a GGUF file"):
        make_scheduler(source[0], quant="gguf")


def test_dummy_blocks_of_the_chosen_type(source: tuple[str, Any]) -> None:
    sched = make_scheduler(source[0], quant="gguf", load_format="dummy", plugin_options={"gguf": {"dummy_type": "Q4_K"}})
    qkv = sched.runner.model.model.layers[1].self_attn.qkv_proj
    assert qkv.gguf_segments[0][0] == formats.Q4_K and qkv.weight.dtype == torch.uint8
    assert qkv.weight_type.tolist() == [formats.Q4_K] * 3
    out = generate_greedy(sched, PROMPTS[:1], 4)
    assert len(out[0]) == 4


def test_dummy_without_a_type_and_an_unknown_type_are_clear_errors(source: tuple[str, Any]) -> None:
    with pytest.raises(ModelLoadError, match=r"--plugin-option gguf.dummy_type=TYPE \(accepted: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K\)"):
        make_scheduler(source[0], quant="gguf", load_format="dummy")
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"gguf.dummy_type: invalid value 'Q3_K'; accepted: Q4_0"):
        make_scheduler(source[0], quant="gguf", load_format="dummy", plugin_options={"gguf": {"dummy_type": "Q3_K"}})


def test_a_type_nothing_can_dequantize_is_a_clear_error(tmp_path: pathlib.Path, source: tuple[str, Any]) -> None:
    path = str(tmp_path / "q8_1.gguf")
    write_tiny_gguf(path, source[1], "Q8_0", overrides={"o_proj": "Q8_1"})
    with pytest.raises(ModelLoadError, match=r"attn_output.weight .* stored as Q8_1, which the gguf package cannot dequantize"):
        resolve_checkpoint(path)


def test_the_layer_refuses_blocks_of_a_type_it_cannot_keep_or_dequantize() -> None:
    from engine.layers.linear import RowParallelLinear
    from engine_quant_gguf.config import GGUFConfig

    layer = RowParallelLinear(64, 16, quant_config=GGUFConfig(), prefix="model.layers.0.mlp.down_proj")
    layer.weight_type.weight_loader(layer.weight_type, torch.tensor([9], dtype=torch.int32))  # Q8_1
    with pytest.raises(ModelLoadError, match=r"down_proj: GGUF type Q8_1 can neither be kept .* nor dequantized"):
        layer.weight.weight_loader(layer.weight, torch.zeros(16, 80, dtype=torch.uint8))


class TestGGUFQ8_0Conformance(QuantMethodConformance):
    """The kit's layers (128 inputs) from Q8_0 blocks made by gguf's quantizer, loaded per shard
    as a checkpoint (``weight`` blocks + ``weight_type``); relative error of such layers measured
    at 0.0055 (Q8_0), 0.088 (Q4_0), 0.079 (Q4_1) on random 96x128 weights."""

    method_name = "gguf"
    max_rel_error = 0.01
    on_the_fly = False
    serialized_config = {"quant_method": "gguf"}
    qtype = "Q8_0"

    def serialize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        import gguf

        qt = gguf.GGMLQuantizationType[self.qtype]
        blocks = gguf.quants.quantize(weight.float().numpy(), qt)
        return {"weight": torch.from_numpy(blocks), "weight_type": torch.tensor([int(qt)], dtype=torch.int32)}


class TestGGUFQ4_0Conformance(TestGGUFQ8_0Conformance):
    """Q4_0 blocks (4-bit codes, one scale per 32)."""

    max_rel_error = 0.12
    qtype = "Q4_0"


class TestGGUFQ4_1Conformance(TestGGUFQ8_0Conformance):
    """Q4_1 blocks (4-bit codes, a scale and a minimum per 32)."""

    max_rel_error = 0.1
    qtype = "Q4_1"


def test_quant_gguf_needs_no_dequantized_copy_on_disk(tmp_path: pathlib.Path, source: tuple[str, Any]) -> None:
    """``--quant gguf`` reads every tensor from the GGUF: its conversion holds config and tokenizer
    only (``-config``), serves exactly as the full conversion does, and a later full conversion is
    reused by ``--quant gguf`` rather than a second directory."""
    import glob

    path = str(tmp_path / "tiny-Q4_K.gguf")
    write_tiny_gguf(path, source[1], "Q4_K")
    light = resolve_checkpoint(path, weights=False)
    assert light.endswith("-config") and os.path.isfile(os.path.join(light, "config.json"))
    assert not glob.glob(os.path.join(light, "*.safetensors"))
    full = resolve_checkpoint(path)
    assert glob.glob(os.path.join(full, "*.safetensors"))
    assert generate_greedy(make_scheduler(light, quant="gguf"), PROMPTS, 8) == \
        generate_greedy(make_scheduler(full, quant="gguf"), PROMPTS, 8)
    # With no --quant the CPU keeps GGUF blocks by default (KEEP_GGUF_QUANTIZED_ON_CPU): the light
    # conversion serves as is; without the plugin the weights would have to be on disk.
    assert generate_greedy(make_scheduler(light), PROMPTS, 8) == generate_greedy(make_scheduler(full), PROMPTS, 8)
    with pytest.raises(ModelLoadError, match="no weights found"):
        make_scheduler(light, disable_plugin=["gguf"])
    shutil.rmtree(light)
    assert resolve_checkpoint(path, weights=False) == full
