"""End to end: ``--dp-size 2`` behind one server, with the cache-aware router (CPU, tiny checkpoint)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import Server, free_port, launch, running, server_info, shared_server  # noqa: E402

_GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Iterator[Server]:
    # cache_threshold 0.5: a prompt goes by prefix only when more than half of it matches.
    server = launch(llama_ckpt_dir, str(tmp_path_factory.mktemp("dp-logs")), "--dp-size", "2",
                    "--router-policy", "cache-aware", "--plugin-option", "router_policies.cache_threshold=0.5")
    with running(server, stop_signal=signal.SIGKILL):
        yield server


def _generate(server: Server, input_ids: list[int]) -> dict[str, Any]:
    r = server.post("/generate", json={"input_ids": input_ids, "sampling_params": _GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def _concurrently(server: Server, prompts: list[list[int]]) -> list[dict[str, Any]]:
    out: list[Any] = [None] * len(prompts)

    def run(i: int) -> None:
        out[i] = _generate(server, prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_dp2_greedy_outputs_equal_dp1(dp_server: Server, pytestconfig: pytest.Config,
                                      tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> None:
    single = shared_server(pytestconfig, tmp_path_factory, llama_ckpt_dir)
    prompts = [[7 + i, 20 + 3 * i, 5, 9 + i, 11] for i in range(6)]
    got = _concurrently(dp_server, prompts)
    want = [_generate(single, p) for p in prompts]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    # Unrelated prompts arriving together are spread over both replicas.
    assert {o["meta_info"]["dp_rank"] for o in got} == {0, 1}
    assert "dp_rank" not in want[0]["meta_info"]  # one replica: no replica reported


def test_shared_prefixes_land_on_the_same_replica(dp_server: Server) -> None:
    before = server_info(dp_server)["router"]
    group_a = [list(range(30, 60)) + [i, i + 1] for i in range(4)]
    group_b = [list(range(60, 90)) + [i, i + 2] for i in range(4)]
    ranks_a = [_generate(dp_server, p)["meta_info"]["dp_rank"] for p in group_a]
    ranks_b = [_generate(dp_server, p)["meta_info"]["dp_rank"] for p in group_b]
    assert len(set(ranks_a)) == 1 and len(set(ranks_b)) == 1, (ranks_a, ranks_b)
    info = server_info(dp_server)
    router = info["router"]
    assert router["policy"] == "cache-aware" and router["dp_size"] == 2
    hits = sum(r["decisions"].get("cache_hit", 0) for r in router["replicas"])
    hits_before = sum(r["decisions"].get("cache_hit", 0) for r in before["replicas"])
    assert hits - hits_before >= 6  # every request after each group's first
    # Per-replica load and both replicas' scheduler numbers.
    assert len(info["internal_states"]) == 2 and len(info["dp_replicas"]) == 2
    for replica in router["replicas"]:
        assert {"in_flight_requests", "routed_requests", "num_running_reqs", "num_waiting_reqs", "kv_usage"} <= set(replica)
    assert info["max_total_num_tokens"] == sum(r["max_total_num_tokens"] for r in info["dp_replicas"])
    # The same decisions in /metrics.
    text = dp_server.get("/metrics").text
    counted = sum(float(v) for v in re.findall(r'engine_router_requests_total\{[^}]*reason="cache_hit"[^}]*\} (\S+)', text))
    assert counted == hits
    assert re.search(r'engine_router_in_flight_requests\{[^}]*replica="1"', text)
    assert re.search(r'engine_replica_num_running_reqs\{[^}]*replica="0"', text)


def test_abort_and_flush_reach_every_replica(dp_server: Server) -> None:
    results: dict[str, Any] = {}

    def long_request(rid: str, ids: list[int]) -> None:
        body = {"rid": rid, "input_ids": ids, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        results[rid] = dp_server.post("/generate", json=body)

    # Two long requests, on different replicas (the second finds the first one's replica busier).
    threads = [threading.Thread(target=long_request, args=(f"long{i}", [90 + i, 3, 4])) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        replicas = server_info(dp_server)["router"]["replicas"]
        if all(r["in_flight_requests"] == 1 for r in replicas):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the two requests did not run on both replicas: {replicas}")
    assert dp_server.post("/flush_cache").status_code == 400  # busy replicas refuse
    for i in range(2):
        r = dp_server.post("/abort_request", json={"rid": f"long{i}"})
        assert r.status_code == 200, r.text
    for t in threads:
        t.join(60)
    for i in range(2):
        assert results[f"long{i}"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert dp_server.post("/flush_cache").status_code == 200
    tree_tokens = server_info(dp_server)["router"]["policy_state"]["tree_tokens"]
    assert tree_tokens == [0, 0]  # the router forgets what the flushed caches held


def test_a_dying_replica_ends_the_server(dp_server: Server) -> None:
    children = dp_server.engine_children()  # started as fresh interpreters or forked
    assert len(children) >= 3, children  # two schedulers and the detokenizer
    os.kill(sorted(children)[1], signal.SIGKILL)  # started second: replica 1's scheduler
    started = time.monotonic()
    code = dp_server.proc.wait(15)
    # Seconds, not minutes (the single-scheduler test asks < 5 s; with one more process to stop
    # on a loaded 2-core machine, allow 10).
    assert code != 0 and time.monotonic() - started < 10
    assert re.search(r"engine process '(scheduler dp\d|detokenizer)' died", dp_server.log()), dp_server.log()[-2000:]


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_bad_dp_size_and_router_policy_are_one_line_errors(llama_ckpt_dir: str) -> None:
    done = _run_cli("serve", "--model-path", llama_ckpt_dir, "--dp-size", "0")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: --dp-size: invalid value 0; accepted: an integer >= 1"]
    done = _run_cli("serve", "--model-path", llama_ckpt_dir, "--port", str(free_port()), "--dp-size", "2",
                    "--router-policy", "cache-awre")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --router-policy: unknown router policy 'cache-awre'") and "round-robin" in last, last
    assert "did you mean cache-aware" in last


def test_offline_engine_round_robin_alternates(llama_ckpt_dir: str) -> None:
    from engine.entrypoints.engine import Engine

    engine = Engine(model_path=llama_ckpt_dir, dp_size=2, router_policy="round-robin", max_total_tokens=4096)
    try:
        ranks = [engine.generate(input_ids=[5, 6, 7], sampling_params=_GREEDY)["meta_info"]["dp_rank"] for _ in range(4)]
        assert ranks == [0, 1, 0, 1]
        info = engine.get_server_info()
        assert [r["decisions"] for r in info["router"]["replicas"]] == [{"round_robin": 2}, {"round_robin": 2}]
    finally:
        engine.shutdown()
