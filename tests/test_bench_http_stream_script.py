"""``benchmarks/bench_http_stream.py``: a row's ``arrivals_s`` covers the requests that reached
the scheduler stand-in in that run (``arrived``), never an earlier run's; a refused request ends
the run with the server's answer instead of leaving it waiting for clients that are gone."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_http_stream.py"


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("bench_http_stream", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arrival_times_cover_only_the_requests_that_arrived() -> None:
    arrival_times = _bench().arrival_times  # type: ignore[attr-defined]
    # Two of four planned arrived: the last two entries are an earlier run's.
    assert arrival_times([10.5, 11.0, 30.0, 31.0], 2, 10.0) == [0.5, 1.0, 1.0]
    assert arrival_times([10.5, 11.0, 12.0, 13.0], 4, 10.0) == [0.5, 2.0, 3.0]
    assert arrival_times([10.5, 11.0], 5, 10.0) == [0.5, 1.0, 1.0]  # more arrived than recorded
    assert arrival_times([30.0, 31.0], 0, 10.0) == []


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--output-len", "2", "--step-ms", "5", *args],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_each_routes_row_reports_its_own_arrivals() -> None:
    proc = _run("--streams", "3", "--routes", "generate", "chat")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["route"] for r in rows] == ["generate", "chat"]
    for row in rows:
        assert row["arrived"] == 3 and row["events"] > 0
        first, middle, last = row["arrivals_s"]
        assert 0 <= first <= middle <= last < row["wall_s"] + 1


def test_a_refused_request_ends_the_run_naming_the_servers_answer() -> None:
    proc = _run("--streams", "2", "--prompt-len", "70000")  # past the stand-in's context length
    assert proc.returncode != 0
    assert "generate (warm-up): /generate: HTTP/1.1 400" in proc.stderr, proc.stderr[-3000:]
    assert "context length is 65536" in proc.stderr


def test_a_client_process_that_ends_without_a_result_ends_the_run() -> None:
    """A client process killed before it answers (a signal, an error before its queue put) ends the
    run naming the route and its exit code, instead of the parent waiting on the queue forever."""
    result_of = _bench()._result_of  # type: ignore[attr-defined]
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    dead = ctx.Process(target=os._exit, args=(3,))
    dead.start()
    dead.join(60)
    with pytest.raises(SystemExit, match=r"generate: the client process ended without a result \(exit code 3\)"):
        result_of(dead, result, "generate")
    result.put((0.0, [(1, 2, 3)]))  # an answer already queued is returned, whether or not the process lives
    assert result_of(dead, result, "generate") == (0.0, [(1, 2, 3)])
