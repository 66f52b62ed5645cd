"""Per-request results and the aggregate serving metrics ``engine bench`` reports.

Definitions follow SGLang's bench_serving so numbers are comparable across engines:
TTFT is time to the first non-empty chunk, TPOT is ``(latency - ttft) / (output_len - 1)``
per request, ITL pools every inter-token gap of every request, concurrency is the summed
request latency over the benchmark duration. Times are kept in seconds and reported in ms.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class RequestResult:
    """What one request did; failures carry ``error`` and are excluded from the statistics."""

    # True when the server answered 200 and the stream ended without an error event.
    success: bool = False
    # Why the request failed ("HTTP 500: ...", exception text); empty on success.
    error: str = ""
    # Prompt tokens, copied from the BenchRequest.
    prompt_len: int = 0
    # Generated tokens: server-reported when available, else counted (see serving docs).
    output_len: int = 0
    # Seconds from send to the first non-empty chunk (== latency without streaming).
    ttft: float = 0.0
    # Seconds between consecutive tokens after the first (gaps of multi-token chunks split evenly).
    itl: list[float] = field(default_factory=list)
    # Seconds from send to the end of the response.
    latency: float = 0.0
    # Full generated text, kept for --output-details and re-tokenization checks.
    generated_text: str = ""
    # time.perf_counter() when the request was sent; only differences are meaningful.
    start_time: float = 0.0


@dataclass
class LatencyStats:
    """Summary of one latency distribution, in milliseconds (all zero when it is empty)."""

    mean_ms: float = 0.0
    median_ms: float = 0.0
    std_ms: float = 0.0
    p90_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0

    @classmethod
    def from_seconds(cls, values: list[float]) -> LatencyStats:
        """Summarise ``values`` (seconds); percentiles interpolate linearly like numpy's default."""
        if not values:
            return cls()
        import numpy as np  # here: building the bench command line must not pay for numpy

        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p90, p95, p99 = np.percentile(ms, [90, 95, 99])
        return cls(
            mean_ms=float(ms.mean()),
            median_ms=float(np.median(ms)),
            std_ms=float(ms.std()),
            p90_ms=float(p90),
            p95_ms=float(p95),
            p99_ms=float(p99),
            max_ms=float(ms.max()),
        )


@dataclass
class BenchMetrics:
    """Aggregate result of one benchmark run."""

    # Successful / failed request counts.
    completed: int
    failed: int
    # Tokens over successful requests.
    total_input_tokens: int
    total_output_tokens: int
    # Wall-clock seconds of the measured run (warmup excluded).
    duration_s: float
    # Per-second rates over duration_s.
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    # Mean number of requests in flight: sum of latencies / duration.
    concurrency: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e_latency: LatencyStats

    def as_dict(self) -> dict[str, Any]:
        """Flat dict with SGLang's result-file keys (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, LatencyStats):
                for stat, number in asdict(value).items():
                    kind = stat.removesuffix("_ms")
                    out[f"{kind}_{f.name}_ms"] = number
            else:
                out[f.name] = value
        out["duration"] = out.pop("duration_s")
        return out


def compute_metrics(results: list[RequestResult], duration: float) -> BenchMetrics:
    """Aggregate per-request results over a run that took ``duration`` seconds.

    Failed requests count only towards ``failed``; TPOT is taken only from requests that
    produced more than one token, since a single token has no decode phase.
    """
    if duration <= 0:
        raise ValueError(f"benchmark duration must be > 0 seconds, got {duration}")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    latencies = [r.latency for r in ok]
    return BenchMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        duration_s=duration,
        request_throughput=len(ok) / duration,
        input_throughput=total_in / duration,
        output_throughput=total_out / duration,
        total_throughput=(total_in + total_out) / duration,
        concurrency=sum(latencies) / duration,
        ttft=LatencyStats.from_seconds([r.ttft for r in ok]),
        tpot=LatencyStats.from_seconds(tpots),
        itl=LatencyStats.from_seconds(itls),
        e2e_latency=LatencyStats.from_seconds(latencies),
    )


_WIDTH = 50


def format_report(
    metrics: BenchMetrics,
    title: str = "Serving Benchmark Result",
    settings: dict[str, Any] | None = None,
) -> str:
    """A human-readable table in the shape of SGLang's report, one metric per line.

    Args:
        metrics: what to report.
        title: centred in the ``====`` header line.
        settings: run settings printed first (backend, request rate, ...), in order.
    """
    lines = [f" {title} ".center(_WIDTH, "=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:<10.2f}" if isinstance(value, float) else f"{value!s:<10}"
        lines.append(f"{label:<40} {text}".rstrip())

    for label, value in (settings or {}).items():
        row(f"{label}:", value)
    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    row("Benchmark duration (s):", metrics.duration_s)
    row("Total input tokens:", metrics.total_input_tokens)
    row("Total generated tokens:", metrics.total_output_tokens)
    row("Request throughput (req/s):", metrics.request_throughput)
    row("Input token throughput (tok/s):", metrics.input_throughput)
    row("Output token throughput (tok/s):", metrics.output_throughput)
    row("Total token throughput (tok/s):", metrics.total_throughput)
    row("Concurrency:", metrics.concurrency)
    sections = (
        ("End-to-End Latency", "E2E Latency", metrics.e2e_latency),
        ("Time to First Token", "TTFT", metrics.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", metrics.tpot),
        ("Inter-Token Latency", "ITL", metrics.itl),
    )
    for heading, short, stats in sections:
        lines.append(heading.center(_WIDTH, "-"))
        row(f"Mean {short} (ms):", stats.mean_ms)
        row(f"Median {short} (ms):", stats.median_ms)
        row(f"Std {short} (ms):", stats.std_ms)
        row(f"P90 {short} (ms):", stats.p90_ms)
        row(f"P95 {short} (ms):", stats.p95_ms)
        row(f"P99 {short} (ms):", stats.p99_ms)
        row(f"Max {short} (ms):", stats.max_ms)
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def to_json_line(metrics: BenchMetrics, extra: dict[str, Any] | None = None) -> str:
    """One JSON line (no trailing newline) for appending to ``--result-file``.

    ``extra`` (run settings, per-request details) is merged first so metric keys win on a
    clash. Non-finite floats such as ``request_rate=inf`` become strings: strict JSON
    readers reject ``Infinity``.
    """
    record = {**(extra or {}), **metrics.as_dict()}
    return json.dumps(_finite(record))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
