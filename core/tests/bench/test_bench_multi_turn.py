"""``engine bench multi-turn`` against a real ``engine serve`` (tiny random Llama, CPU) whose
device pool is too small for the conversations: turns run round-robin, each resends the whole
conversation (the answers' ids included), the returning conversations' prefixes come back from
the hierarchical cache's host tier, and the report and result line say so."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from engine.bench.multi_turn import MultiTurnArgs, bench_multi_turn
from engine.cli import app
from engine.ports import free_port

CONVS, TURNS, HISTORY, USER, OUT = 3, 3, 48, 8, 4


@pytest.fixture(scope="module")
def server_url(llama_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("multi-turn") / "server.log"
    # 128 slots hold about two conversations: the third evicts the first before it returns.
    cmd = [sys.executable, "-m", "engine", "serve", "--model-path", llama_ckpt, "--host", "127.0.0.1",
           "--port", str(port), "--max-total-tokens", "128", "--enable-hierarchical-cache",
           "--hicache-write-policy", "write_back"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"engine serve exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"engine serve not healthy: {log_path.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_conversations_return_to_their_prefix_in_the_host_tier(server_url: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    result_file = tmp_path / "mt.jsonl"
    args = MultiTurnArgs(base_url=server_url, num_conversations=CONVS, num_turns=TURNS, history_len=HISTORY,
                         turn_input_len=USER, output_len=OUT, max_concurrency=1, result_file=str(result_file))
    metrics, turns = bench_multi_turn(args)
    assert metrics.completed == CONVS * TURNS and metrics.failed == 0
    # Round-robin: every conversation's turn t starts before any conversation's turn t + 1.
    order = [(t.turn, t.conversation) for t in sorted(turns, key=lambda t: t.result.start_time)]
    assert order == sorted(order)
    for t in turns:
        # The whole conversation is resent: history, then per earlier turn its message and answer.
        assert t.result.prompt_len == HISTORY + t.turn * (USER + OUT) + USER
        assert t.result.output_len == OUT
    # A returning conversation's history (evicted from the 128-slot pool meanwhile) is reused.
    assert all(t.cached_tokens >= HISTORY for t in turns if t.turn > 0), [(t.turn, t.cached_tokens) for t in turns]
    out = capsys.readouterr().out
    assert "Multi-turn Benchmark Result" in out and "Cached prompt tokens:" in out
    line = json.loads(result_file.read_text().splitlines()[-1])
    assert line["bench"] == "multi-turn" and line["completed"] == CONVS * TURNS
    assert line["hicache_host_hit_tokens"] >= HISTORY, line  # served from host memory, not recomputed
    assert line["hicache_host_capacity_tokens"] > 0 and line["hicache_bytes_loaded"] > 0, line
    assert 0 < line["cached_token_ratio"] < 1 and [r["turn"] for r in line["per_turn"]] == list(range(TURNS))
    assert line["per_turn"][0]["cached_ratio"] == 0.0  # the server's cache was flushed first


def test_bad_flags_exit_2_with_one_line() -> None:
    for argv, message in ((["--num-turns", "0"], "--num-turns: invalid value 0; accepted: >= 1"),
                          (["--request-rate", "fast"], "--request-rate: invalid value 'fast'"),
                          (["--history-len", "-1"], "--history-len: invalid value -1; accepted: >= 0")):
        result = CliRunner().invoke(app, ["bench", "multi-turn", *argv])
        assert result.exit_code == 2 and message in result.output, result.output


def test_an_unreachable_server_is_a_clear_error() -> None:
    port = free_port()
    result = CliRunner().invoke(app, ["bench", "multi-turn", "--port", str(port)])
    assert result.exit_code == 2 and "pass --vocab-size" in result.output, result.output
