"""``engine bench cpu-compare``: its flags are checked before anything loads, a non-GGUF model is
refused with the reason, llama.cpp's absence is said in one line, and the summary line carries the
ratios and the load. (The speeds themselves live in docs/bench_results, not in tests.)"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from engine.bench import cpu_compare
from engine.cli import app

runner = CliRunner()


@pytest.mark.parametrize("argv, message", [
    (["--output-len", "1"], "--output-len: invalid value 1; accepted: >= 2"),
    (["--rounds", "0"], "--rounds: invalid value 0; accepted: >= 1"),
    (["--batch-size", "0"], "--batch-size: invalid value '0'; expected integers >= 1"),
])
def test_bad_flags_fail_before_loading(argv: list[str], message: str) -> None:
    res = runner.invoke(app, ["bench", "cpu-compare", *argv])
    assert res.exit_code == 2
    assert message in res.output


def test_a_model_that_is_not_a_gguf_is_refused(tmp_path: Any) -> None:
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "tiny"))
    res = runner.invoke(app, ["bench", "cpu-compare", "--model-path", path, "--platform", "cpu"])
    assert res.exit_code == 2
    assert f"--model-path: {path} is not a GGUF file" in res.output


def test_llama_cpp_missing_is_none_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as where it is not installed
    assert cpu_compare.load_llama_cpp("unused.gguf", 64, 1) is None
    assert "pip install llama-cpp-python" in cpu_compare.LLAMA_CPP_MISSING


def test_the_summary_line_has_rates_ttfts_ratios_and_load() -> None:
    row = {"batch_size": 1, "engine_tok_s": 40.0, "engine_ttft_ms": 120.0, "transformers_tok_s": 16.0,
           "transformers_ttft_ms": 300.0, "llama_cpp_tok_s": 80.0, "llama_cpp_ttft_ms": 50.0, "load_avg": 2.5}
    assert cpu_compare.describe(row) == (
        "batch 1: engine 40.0 tok/s (TTFT 120 ms); transformers 16.0 tok/s (TTFT 300 ms); "
        "llama.cpp 80.0 tok/s (TTFT 50 ms); engine 2.50x transformers, 0.50x llama.cpp (load average 2.5)")
    row.update(llama_cpp_tok_s=None, llama_cpp_ttft_ms=None)
    assert cpu_compare.describe(row).endswith("engine 2.50x transformers (load average 2.5)")
