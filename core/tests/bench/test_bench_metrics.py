"""Tests for engine.bench.metrics on hand-made results with known statistics."""

from __future__ import annotations

import json
import math

import pytest

from engine.bench.metrics import (
    LatencyStats,
    RequestResult,
    compute_metrics,
    format_report,
    to_json_line,
)


def _results() -> list[RequestResult]:
    # Five successes with TTFT 10..50 ms, each 1 s long with 11 tokens -> TPOT 90..50 ms.
    ok = [
        RequestResult(
            success=True, prompt_len=100, output_len=11, ttft=t / 1000, latency=1.0,
            itl=[0.01, 0.03],
        )  # fmt: skip
        for t in (10, 20, 30, 40, 50)
    ]
    # A single-token success: has a TTFT and a latency but no TPOT.
    single = RequestResult(success=True, prompt_len=50, output_len=1, ttft=0.06, latency=0.06)
    # A failure with absurd numbers that must not leak into any statistic.
    failed = RequestResult(
        success=False, error="HTTP 500", prompt_len=999, output_len=999, ttft=99.0, latency=99.0
    )
    return [*ok, single, failed]


def test_counts_and_throughputs() -> None:
    m = compute_metrics(_results(), duration=2.0)
    assert (m.completed, m.failed) == (6, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (550, 56)
    assert m.request_throughput == pytest.approx(3.0)
    assert m.input_throughput == pytest.approx(275.0)
    assert m.output_throughput == pytest.approx(28.0)
    assert m.total_throughput == pytest.approx(303.0)
    assert m.concurrency == pytest.approx(5.06 / 2.0)


def test_latency_statistics() -> None:
    m = compute_metrics(_results(), duration=2.0)
    # TTFT over 10, 20, 30, 40, 50, 60 ms.
    assert m.ttft.mean_ms == pytest.approx(35.0)
    assert m.ttft.median_ms == pytest.approx(35.0)
    assert m.ttft.std_ms == pytest.approx(math.sqrt(1750 / 6))
    assert m.ttft.p90_ms == pytest.approx(55.0)
    assert m.ttft.p99_ms == pytest.approx(59.5)
    assert m.ttft.max_ms == pytest.approx(60.0)
    # TPOT = (1.0 - ttft) / 10 for the five multi-token requests: 99, 98, 97, 96, 95 ms.
    assert m.tpot.mean_ms == pytest.approx(97.0)
    assert m.tpot.p95_ms == pytest.approx(98.8)
    # ITL pools 10 and 30 ms five times each.
    assert m.itl.mean_ms == pytest.approx(20.0)
    assert m.itl.median_ms == pytest.approx(20.0)
    assert m.itl.p99_ms == pytest.approx(30.0)
    assert m.e2e_latency.median_ms == pytest.approx(1000.0)
    assert m.e2e_latency.mean_ms == pytest.approx(5060 / 6)


def test_known_percentiles_of_one_to_hundred() -> None:
    stats = LatencyStats.from_seconds([i / 1000 for i in range(1, 101)])
    got = (stats.median_ms, stats.p90_ms, stats.p95_ms, stats.p99_ms)
    assert got == pytest.approx((50.5, 90.1, 95.05, 99.01))


def test_all_failed_or_empty_gives_zero_statistics() -> None:
    m = compute_metrics([RequestResult(success=False, error="x")], duration=1.0)
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 1, 0)
    assert m.ttft == LatencyStats() and m.concurrency == 0.0
    assert compute_metrics([], duration=1.0).completed == 0
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], duration=0.0)


def test_format_report_looks_like_sglang() -> None:
    m = compute_metrics(_results(), duration=2.0)
    report = format_report(m, settings={"Backend": "engine", "Traffic request rate": math.inf})
    lines = report.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert lines[1].split() == ["Backend:", "engine"]
    assert "Traffic request rate:                    inf" in report
    assert any(line.startswith("Successful requests:") and line.endswith("6") for line in lines)
    assert any(line.split() == ["Mean", "TTFT", "(ms):", "35.00"] for line in lines)
    assert any(line.split() == ["P99", "ITL", "(ms):", "30.00"] for line in lines)
    assert "-----Time to First Token-----" in report
    assert format_report(m, title="Offline").splitlines()[0].strip("= ") == "Offline"


def test_json_line_has_sglang_keys_and_strict_json() -> None:
    m = compute_metrics(_results(), duration=2.0)
    line = to_json_line(m, {"backend": "engine", "request_rate": math.inf, "completed": -1})
    assert "\n" not in line and "Infinity" not in line
    record = json.loads(line)
    assert record["backend"] == "engine" and record["request_rate"] == "inf"
    assert record["completed"] == 6  # metrics win over a clashing extra key
    assert record["duration"] == 2.0 and record["total_output_tokens"] == 56
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2e_latency_ms"):
        assert key in record
    assert record["mean_ttft_ms"] == pytest.approx(35.0)
