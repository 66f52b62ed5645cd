"""``engine bench report``: the benchmarks page from result rows (one table per area, the newest row
per configuration and device, ratios to the roofline or to the peer), its input checks, and that
the committed docs/benchmarks.md is what the committed result files give."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from typer.testing import CliRunner

from engine.bench.report import AREAS, ReportError, build_page, device_name, read_rows
from engine.cli import app

REPO = pathlib.Path(__file__).resolve().parents[3]
H100 = "cuda:0 NVIDIA H100 80GB HBM3 (sm_90, 79.2 GiB, 132 SMs), CUDA 13.0, torch 2.11.0+cu130"
H200 = "cuda:0 NVIDIA H200 (sm_90, 139.8 GiB, 132 SMs), CUDA 13.0, torch 2.11.0+cu130"
runner = CliRunner()


def _one_batch(ms: float, batch: int = 1, **extra: Any) -> dict[str, Any]:
    return {"bench": "one-batch", "device": H100, "attention": "triton", "tp_size": 1, "pp_size": 1, "ep_size": 1,
            "json_schema": False, "batch_size": batch, "input_len": 128, "output_len": 256,
            "prefill_latency_s": 0.02, "prefill_throughput": 6400.0 * batch,
            "median_decode_latency_s": ms / 1e3, "median_decode_throughput": batch * 1e3 / ms,
            "command": "engine bench one-batch --batch-size 1", "date": "2026-11-24", **extra}


def _write(path: pathlib.Path, *rows: dict[str, Any]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _table(page: str, heading: str) -> list[list[str]]:
    """The data rows of the table under ``## heading``, as lists of cells."""
    section = page.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")][1:]  # past the header row
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def test_tables_hold_the_newest_row_per_configuration_and_device(tmp_path: pathlib.Path) -> None:
    cfg = {"area": "decode", "config": "8B, triton, batch 1", "weight_gb": 16.06}
    old = _one_batch(6.105, **cfg, date="2026-11-22 03:38")
    new = _one_batch(5.494, **cfg, date="2026-11-24 03:58")
    other_card = _one_batch(4.130, **{**cfg, "device": H200}, date="2026-11-24 22:45")
    page = build_page([_write(tmp_path / "a.jsonl", new, old), _write(tmp_path / "b.jsonl", other_card)])

    for area in AREAS:
        assert f"\n## {area.heading}\n" in page
    rows = _table(page, "Decode latency")
    assert [(r[2], r[3], r[4]) for r in rows] == [("H100 80GB HBM3", "2026-11-24 03:58", "5.494 ms/step (182.0 tok/s)"),
                                                 ("H200", "2026-11-24 22:45", "4.130 ms/step (242.1 tok/s)")]
    assert rows[0][0] == "8B, triton, batch 1" and rows[0][1] == "`engine bench one-batch --batch-size 1`"
    # 16.06 GB at 3.02 TB/s is 5.32 ms; at 4.29 TB/s 3.74 ms.
    assert rows[0][5] == "0.97 of the roofline (5.32 ms: 16.06 GB at 3.02 TB/s)"
    assert rows[1][5].startswith("0.91 of the roofline (3.74 ms")
    assert "Result files: `a.jsonl`, `b.jsonl`." in page


def test_ratios_to_the_peer_and_to_figures_the_row_carries(tmp_path: pathlib.Path) -> None:
    quant = _one_batch(3.605, area="quantization", config="8B, fp8, batch 1",
                       peer={"config": "bf16, same call", "median_decode_latency_s": 0.006119,
                             "median_decode_throughput": 163.4})
    kernel = {"bench": "kernel", "area": "moe", "config": "MoE layer, 64 tokens", "us": 478.0,
              "peer": {"config": "per-expert loop", "us": 24225.0}, "device": "NVIDIA H100 80GB HBM3",
              "command": "python3 benchmarks/bench_moe_kernel.py", "date": "2026-11-23"}
    cpu = {"bench": "default-model-cpu-decode", "machine": "x86_64, 2 cores", "batch_size": 1, "engine_tok_s": 14.9,
           "transformers_tok_s": 15.1, "command": "python3 benchmarks/bench_default_model_cpu.py", "date": "2026-11-23"}
    startup = {"model_path": None, "floor_s": 4.83, "generate_s": 5.63, "serve_s": 6.12, "machine": "2 cores",
               "command": "engine bench startup", "date": "2026-11-23 03:17"}
    page = build_page([_write(tmp_path / "r.jsonl", quant, kernel, cpu, startup)])

    assert _table(page, "Quantization")[0][4:] == ["3.605 ms/step (277.4 tok/s)", "1.70x bf16, same call"]
    # Lower is better for a time: the ratio is the peer's time over the row's.
    assert _table(page, "Mixture of experts")[0][4:] == ["478.0 us", "50.68x per-expert loop"]
    assert _table(page, "CPU default model")[0][5] == "0.99x transformers `generate`, same run"
    assert _table(page, "Start-up")[0][4:] == ["Engine 5.63 s, serve 6.12 s (import floor 4.83 s)",
                                               "1.17x / 1.27x the import floor"]


def test_rows_as_benchmarks_write_them_find_their_area_and_configuration(tmp_path: pathlib.Path) -> None:
    tp2 = _one_batch(2.761, tp_size=2, model_path="docs/bench_configs/llama-3-8b", quant=None)
    grammar = _one_batch(7.688, batch=64, json_schema=True)
    fp8 = {"bench": "offline", "dataset": "random", "num_prompts": 1000, "duration_s": 106.3, "output_throughput": 9631.0,
           "device": "NVIDIA H100 80GB HBM3", "model_path": None, "quant": "fp8", "tp_size": 1, "attention": "triton",
           "command": "engine bench offline --quant fp8", "date": "2026-11-23"}
    page = build_page([_write(tmp_path / "raw.jsonl", tp2, grammar, fp8)])

    assert _table(page, "Parallelism")[0][:1] == ["llama-3-8b, triton, batch 1, 128 in / 256 out, TP=2"]
    assert _table(page, "Parallelism")[0][2] == "2x H100 80GB HBM3"
    assert _table(page, "Structured output")[0][4] == "7.688 ms/step (8,325 tok/s)"
    assert _table(page, "Quantization")[0][0] == "default model, fp8, triton, random, 1000 prompts"
    assert _table(page, "Quantization")[0][4] == "9,631 output tok/s (106.3 s)"
    # A row with the run's split (engine bench offline reports one) shows it.
    split = {**fp8, "date": "2026-11-24", "extend_time_s": 16.08, "decode_time_s": 61.06, "decode_steps": 2047}
    page = build_page([_write(tmp_path / "split.jsonl", split)])
    assert _table(page, "Quantization")[0][4] == "9,631 output tok/s (106.3 s: prefill 16.1 s, decode 61.1 s in 2,047 steps)"
    hf = {"bench": "hf-baseline", "device": "NVIDIA H100 80GB HBM3", "model_path": "docs/bench_configs/llama-3-8b",
          "hf_eager_bs1_tok_s": 10.0, "command": "python3 benchmarks/bench_hf_baseline.py", "date": "2026-11-22",
          "weight_gb": 16.06}
    cpu = {"bench": "default-model-cpu-decode", "machine": "x86_64, 2 cores", "batch_size": 8, "engine_tok_s": 69.7,
           "transformers_tok_s": 74.4, "command": "python3 benchmarks/bench_default_model_cpu.py", "date": "2026-11-23"}
    page = build_page([_write(tmp_path / "more.jsonl", hf, cpu)])
    assert _table(page, "Decode latency")[0][0] == "llama-3-8b, Hugging Face transformers `generate`, hf_eager_bs1_tok_s"
    # A batch-1 rate against the roofline: 10 tok/s is a 100 ms step against 5.32 ms.
    assert _table(page, "Decode latency")[0][5].startswith("0.05 of the roofline")
    assert _table(page, "CPU default model")[0][0] == "default-model-cpu-decode, batch 8"
    assert ("## Offline throughput\n\nNo current measurement; `engine bench offline --result-file F` produces one."
            in page)


def test_cpu_compare_rows_show_all_three_contenders_and_the_load(tmp_path: pathlib.Path) -> None:
    common = {"bench": "cpu-compare", "machine": "2 CPU cores, torch 2.13.0+cpu, 1 thread", "model_path": None,
              "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "input_len": 128, "output_len": 64, "threads": 1,
              "load_avg": 3.04, "command": "engine bench cpu-compare --result-file F", "date": "2026-11-28"}
    one = {**common, "batch_size": 1, "engine_tok_s": 40.0, "engine_ttft_ms": 120.4, "transformers_tok_s": 16.0,
           "transformers_ttft_ms": 300.0, "llama_cpp_tok_s": 80.0, "llama_cpp_ttft_ms": 50.2}
    eight = {**common, "batch_size": 8, "engine_tok_s": 160.0, "engine_ttft_ms": 900.0, "transformers_tok_s": 80.0,
             "transformers_ttft_ms": 2000.0, "llama_cpp_tok_s": None, "llama_cpp_ttft_ms": None}
    rows = _table(build_page([_write(tmp_path / "cpu.jsonl", one, eight)]), "CPU default model")
    assert rows[0][0] == "default model, SmolLM2-135M-Instruct.Q4_1.gguf, batch 1, 128 in / 64 out, 1 thread"
    assert rows[0][4] == ("engine 40.0 tok/s, TTFT 120 ms; transformers 16.0 tok/s, TTFT 300 ms; "
                          "llama.cpp 80.0 tok/s, TTFT 50 ms")
    assert rows[0][5] == "2.50x transformers, 0.50x llama.cpp (same run, load average 3.0)"
    assert rows[1][4] == "engine 160.0 tok/s, TTFT 900 ms; transformers 80.0 tok/s, TTFT 2,000 ms"
    assert rows[1][5] == "2.00x transformers (same run, load average 3.0)"


@pytest.mark.parametrize("change, message", [
    ({"area": "latency"}, "r.jsonl:1: field 'area': invalid value 'latency'; accepted: decode, offline,"),
    ({"date": "24/11/2026"}, "r.jsonl:1: field 'date': invalid value '24/11/2026'; expected UTC 'YYYY-MM-DD'"),
    ({"command": ""}, "r.jsonl:1: field 'command': missing or empty"),
    ({"weight_gb": -1}, "r.jsonl:1: field 'weight_gb': invalid value -1; expected GB > 0"),
    ({"peer": {"us": 3}}, "r.jsonl:1: field 'peer': invalid value"),
    ({"median_decode_latency_s": "fast"}, "r.jsonl:1: bench 'one-batch': a field of its figure is not a number"),
    ({"median_decode_latency_s": None}, None),
])
def test_bad_rows_are_refused_naming_file_line_field_and_value(tmp_path: pathlib.Path, change: dict[str, Any],
                                                               message: str | None) -> None:
    row = {**_one_batch(5.0), **change}
    if message is None:  # a figure's field missing: named with the bench that needs it
        del row["median_decode_latency_s"]
        message = "r.jsonl:1: bench 'one-batch' needs field 'median_decode_latency_s' for its figure"
    with pytest.raises(ReportError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        read_rows([_write(tmp_path / "r.jsonl", row)])


def test_a_row_of_an_unknown_benchmark_without_an_area_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ReportError, match=r"r\.jsonl:2: no 'area' and none can be inferred from bench 'probe'"):
        read_rows([_write(tmp_path / "r.jsonl", _one_batch(5.0), {"bench": "probe", "us": 1.0})])


def test_device_names() -> None:
    assert device_name({"device": H200, "tp_size": 2, "pp_size": 1}) == "2x H200"
    assert device_name({"device": "NVIDIA H200", "gpus": 2}) == "2x H200"
    assert device_name({"device": "cpu"}) == "CPU"
    assert device_name({"machine": "x86_64, 2 cores"}) == "x86_64, 2 cores"


def test_cli_writes_checks_and_refuses(tmp_path: pathlib.Path) -> None:
    results = str(_write(tmp_path / "r.jsonl", _one_batch(5.494, area="decode", config="8B, batch 1")))
    page = tmp_path / "page.md"
    res = runner.invoke(app, ["bench", "report", results, "--output", str(page)])
    assert res.exit_code == 0, res.output
    assert page.read_text() == build_page([results])
    assert runner.invoke(app, ["bench", "report", results, "--output", str(page), "--check"]).exit_code == 0

    page.write_text(page.read_text().replace("5.494", "5.000"))  # a hand edit
    res = runner.invoke(app, ["bench", "report", results, "--output", str(page), "--check"])
    assert res.exit_code == 1 and "is out of date" in res.output

    res = runner.invoke(app, ["bench", "report", results, "--check"])
    assert res.exit_code == 2 and "--check: needs --output" in res.output
    bad = _write(tmp_path / "bad.jsonl", {**_one_batch(5.0), "area": "speed"})
    res = runner.invoke(app, ["bench", "report", str(bad)])
    assert res.exit_code == 2 and "field 'area': invalid value 'speed'" in res.output


def test_the_committed_page_is_generated_from_the_committed_results() -> None:
    page, results = REPO / "docs" / "benchmarks.md", sorted((REPO / "docs" / "bench_results").glob("*.jsonl"))
    if not page.exists() or not results:
        pytest.skip("not run from a repository checkout (no docs/)")
    assert page.read_text(encoding="utf-8") == build_page(results), (
        "docs/benchmarks.md differs from its result files: regenerate it with "
        "`engine bench report docs/bench_results/*.jsonl --output docs/benchmarks.md` (do not edit it by hand)")


def test_a_startup_row_with_cpu_seconds_shows_them(tmp_path: pathlib.Path) -> None:
    startup = {"bench": "startup", "floor_s": 4.0, "generate_s": 6.0, "serve_s": 5.0, "generate_cpu_s": 11.5,
               "serve_cpu_s": 7.25, "machine": "2 cores", "command": "engine bench startup", "date": "2026-11-28"}
    page = build_page([_write(tmp_path / "r.jsonl", startup)])
    assert _table(page, "Start-up")[0][4] == ("Engine 6.00 s, serve 5.00 s (import floor 4.00 s); "
                                              "CPU-s a run: Engine 11.50, serve 7.25")


def test_a_multi_turn_row_goes_to_kv_cache_tiers_against_its_tier_off_peer(tmp_path: pathlib.Path) -> None:
    row = {"bench": "multi-turn", "device": H200, "num_conversations": 64, "num_turns": 4, "history_len": 2048,
           "turn_input_len": 128, "output_len": 32, "max_concurrency": 16, "request_throughput": 12.5,
           "input_throughput": 30000.0, "median_ttft_ms": 812.4, "cached_token_ratio": 0.71,
           "command": "engine bench multi-turn", "date": "2026-11-29 01:30",
           "peer": {"config": "tier off", "request_throughput": 5.0, "input_throughput": 12000.0,
                    "median_ttft_ms": 3000.0, "cached_token_ratio": 0.2}}
    page = build_page([_write(tmp_path / "kv.jsonl", row)])
    [cells] = _table(page, "KV cache tiers")
    assert cells[0] == "64 conversations x 4 turns, 2048-token histories, 128 in / 32 out a turn, concurrency 16"
    assert cells[4] == "12.50 turns/s (30,000 prompt tok/s), median TTFT 812 ms, 71% of prompt tokens cached"
    assert cells[5] == "2.50x tier off"


def test_a_serving_load_row_shows_throughput_with_its_latencies_against_offline(tmp_path: pathlib.Path) -> None:
    row = {"bench": "serving", "area": "serving", "config": "burst", "figure": "load", "device": H200,
           "command": "engine bench serving", "date": "2026-11-29 06:10", "output_throughput": 9012.4,
           "median_ttft_ms": 8123.4, "p99_ttft_ms": 16020.0, "mean_ttft_ms": 8000.0, "median_itl_ms": 42.04,
           "p99_itl_ms": 61.5, "peer": {"config": "engine bench offline, same data", "output_throughput": 9500.0}}
    [cells] = _table(build_page([_write(tmp_path / "serving.jsonl", row)]), "Serving")
    assert cells[4] == "9,012 output tok/s; TTFT p50 8,123 / p99 16,020 ms; ITL p50 42.0 / p99 61.5 ms"
    assert cells[5] == "0.95x engine bench offline, same data"
