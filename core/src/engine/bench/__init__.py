"""Benchmark tools behind ``engine bench``.

Modules (import them directly; this package imports nothing so ``engine --help`` stays fast):

- ``engine.bench.datasets``: ``BenchRequest``, ``DatasetArgs`` and seeded generators
  (random, generated-shared-prefix); ``engine.bench.sharegpt`` reads ``sharegpt-file``.
- ``engine.bench.metrics``: ``RequestResult``, ``compute_metrics``, ``format_report``,
  ``to_json_line``.
- ``engine.bench.backends``: per-API payloads and the shared streaming/timing loop.
- ``engine.bench.serving_args``: ``BenchServingArgs`` (no HTTP client import).
- ``engine.bench.serving``: the async HTTP load generator, ``benchmark_serving``.
"""

from __future__ import annotations
