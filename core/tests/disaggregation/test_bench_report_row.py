"""A benchmarks/bench_disaggregation.py summary row on the benchmarks page (docs/benchmarks.md):
its area, its figure (KV per request, staging, transfer, write, TTFT, ITL) and its ratio to the
decode server serving the same prompts whole."""

from __future__ import annotations

import json
import pathlib

from engine.bench.report import build_page


def test_a_disaggregation_row_shows_its_transfer_and_its_whole_server_peer(tmp_path: pathlib.Path) -> None:
    row = {"kind": "summary", "bench": "disaggregation", "config": "qwen3-0.6b shape, 4096 in / 128 out",
           "command": "python3 benchmarks/bench_disaggregation.py", "device": "cuda:0 NVIDIA H200",
           "date": "2026-11-29 00:45", "kv_mib": 448.0, "prefill_stage_ms": 21.04, "transfer_ms": 95.5,
           "decode_write_ms": 12.25, "ttft_ms": 180.0, "itl_ms": 1.234,
           "peer": {"config": "whole", "ttft_ms": 45.0, "itl_ms": 1.2}}
    path = tmp_path / "disaggregation.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    section = build_page([path]).split("## Disaggregation\n", 1)[1].split("\n## ", 1)[0]
    cells = [c.strip() for c in section.splitlines()[-1].strip("|").split(" | ")]
    assert cells[0] == "qwen3-0.6b shape, 4096 in / 128 out" and cells[2] == "H200"
    assert cells[4] == ("KV 448 MiB a request: staged 21.0 ms, sent 95.5 ms, written 12.2 ms; "
                        "TTFT 180.0 ms, ITL 1.23 ms")
    assert cells[5] == "0.25x whole"
    # A GPU pool's row names the decode side's host-to-device upload before the write.
    row["decode_upload_ms"] = 30.5
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    section = build_page([path]).split("## Disaggregation\n", 1)[1].split("\n## ", 1)[0]
    assert "sent 95.5 ms, uploaded 30.5 ms, written 12.2 ms; " in section.splitlines()[-1]
    # A host copy run off the prefill server's scheduler thread is named beside its staging.
    row["prefill_copy_ms"] = 9.61
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    section = build_page([path]).split("## Disaggregation\n", 1)[1].split("\n## ", 1)[0]
    assert "staged 21.0 ms (+ 9.6 ms copy beside the next batch), sent 95.5 ms" in section.splitlines()[-1]


def test_a_row_under_load_compares_itl_p99(tmp_path: pathlib.Path) -> None:
    row = {"bench": "disaggregation", "figure": "itl_p99", "config": "16 requests arriving every 100 ms",
           "command": "python3 benchmarks/bench_disaggregation.py", "device": "cuda:0 NVIDIA H200",
           "date": "2026-11-29 00:45", "ttft_ms": 200.0, "itl_ms": 2.5, "itl_p99_ms": 10.0, "output_tok_s": 1500.0,
           "peer": {"config": "whole", "ttft_ms": 50.0, "itl_ms": 3.0, "itl_p99_ms": 25.0, "output_tok_s": 1400.0}}
    path = tmp_path / "disaggregation.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    section = build_page([path]).split("## Disaggregation\n", 1)[1].split("\n## ", 1)[0]
    cells = [c.strip() for c in section.splitlines()[-1].strip("|").split(" | ")]
    assert cells[4] == "TTFT 200.0 ms, ITL 2.50 ms (p99 10.00 ms), 1,500 output tok/s"
    assert cells[5] == "2.50x whole"
