"""`engine bench` on the CPU: the commands run end to end and write their result lines;
`bench serving` drives the real `engine serve` through both request formats."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
from typer.testing import CliRunner

from engine.cli import app

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import API_KEY, MODEL_NAME, Server, assert_no_kv_leak, shared_server, wait_idle  # noqa: E402

runner = CliRunner()


def _lines(path: pathlib.Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_batch_reports_each_combination(tmp_path: pathlib.Path, llama_ckpt_dir: str) -> None:
    out = tmp_path / "r.jsonl"
    res = runner.invoke(app, ["bench", "one-batch", "--model-path", llama_ckpt_dir, "--batch-size", "1 3",
                              "--input-len", "16", "--output-len", "4", "--result-file", str(out)])
    assert res.exit_code == 0, res.output
    rows = _lines(out)
    assert [(r["batch_size"], r["input_len"], r["output_len"]) for r in rows] == [(1, 16, 4), (3, 16, 4)]
    assert all(r["median_decode_latency_s"] > 0 and r["prefill_latency_s"] > 0 for r in rows)


def test_offline_random_and_shared_prefix(tmp_path: pathlib.Path, llama_ckpt_dir: str) -> None:
    out = tmp_path / "o.jsonl"
    base = ["bench", "offline", "--model-path", llama_ckpt_dir, "--max-total-tokens", "8192", "--result-file", str(out)]
    res = runner.invoke(app, base + ["--num-prompts", "12", "--random-input-len", "24", "--random-output-len", "6",
                                     "--random-range-ratio", "1.0"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, base + ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
                                     "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "64",
                                     "--gsp-question-len", "8", "--gsp-output-len", "4"])
    assert res.exit_code == 0, res.output
    random_row, gsp_row = _lines(out)
    assert random_row["num_prompts"] == 12 and random_row["total_output_tokens"] == 12 * 6
    # The step breakdown counts only the timed run: 12 prompts of 24 tokens, 5 decode tokens each.
    assert random_row["extend_tokens"] == 12 * 24 - random_row["cached_tokens"] and random_row["retractions"] == 0
    assert random_row["decode_steps"] >= 5 and 1 <= random_row["mean_decode_batch"] <= 12
    assert 0 < random_row["prefill_time_share"] < 1
    # Every decode step of the run falls in one batch-size band (the samples end with the run's counters).
    assert sum(b["steps"] for b in random_row["decode_by_batch"]) == random_row["decode_steps"], random_row
    assert 0 <= random_row["max_running"] <= 12 and random_row["timeline"], random_row
    assert 0 <= random_row["graph_decode_steps"] <= random_row["decode_steps"]
    assert random_row["device"].startswith("cpu (") and "torch" in random_row["device"], random_row["device"]
    assert gsp_row["num_prompts"] == 8 and gsp_row["cached_tokens"] >= 6 * 64  # later questions reuse the system prompt


def test_bad_bench_flags_exit_2(llama_ckpt_dir: str) -> None:
    res = runner.invoke(app, ["bench", "one-batch", "--model-path", llama_ckpt_dir, "--batch-size", "0"])
    assert res.exit_code == 2 and "--batch-size: invalid value '0'" in res.output
    res = runner.invoke(app, ["bench", "offline", "--model-path", llama_ckpt_dir, "--dataset-name", "sharegpt"])
    assert res.exit_code == 2 and "--dataset-name: invalid value 'sharegpt'" in res.output


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Server:
    return shared_server(request.config, tmp_path_factory, llama_ckpt_dir)


@pytest.mark.parametrize("backend", ["engine", "openai", "openai-chat"])
def test_bench_serving_against_the_real_server(server: Server, tmp_path: pathlib.Path, backend: str,
                                              llama_ckpt_dir: str) -> None:
    out = tmp_path / "s.jsonl"
    # Chat needs text prompts (a tokenizer); the others send exact token-id prompts.
    prompts = (["--tokenizer", llama_ckpt_dir] if backend == "openai-chat"
               else ["--skip-tokenizer-init", "--vocab-size", "2048", "--tokenize-prompt"])
    res = runner.invoke(app, ["bench", "serving", "--backend", backend, "--base-url", server.url,
                              "--model", MODEL_NAME, "--api-key", API_KEY, *prompts, "--num-prompts", "16",
                              "--random-input-len", "20", "--random-output-len", "5", "--random-range-ratio", "1.0",
                              "--request-rate", "50", "--seed", "3", "--disable-tqdm", "--result-file", str(out)])
    assert res.exit_code == 0, res.output
    assert "Serving Benchmark Result" in res.output
    (row,) = _lines(out)
    assert row["completed"] == 16 and row["total_output_tokens"] == 16 * 5, row
    assert row["mean_ttft_ms"] > 0 and row["mean_e2e_latency_ms"] >= row["mean_ttft_ms"]
    # The server's side of the run, from its scheduler counters: 16 x 5 tokens are 16 first tokens
    # (prefill) and 64 decode rows; the client's own CPU time is kept beside it.
    assert row["decode_steps"] >= 4 and row["mean_decode_batch"] * row["decode_steps"] == pytest.approx(64), row
    assert sum(b["steps"] for b in row["decode_by_batch"]) == row["decode_steps"], row
    assert 0 < row["client_cpu_s"] and "Server (scheduler counters over the run)" in res.output
    assert row["device"].startswith("cpu"), row["device"]
    assert_no_kv_leak(wait_idle(server))
