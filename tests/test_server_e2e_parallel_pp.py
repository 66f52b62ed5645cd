"""End to end: a pipeline-parallel server over two "nodes" on one machine (CPU, gloo).

Node 0 runs the HTTP server and stage 0, node 1 only stage 1. Under PP rank 0 talks to the
other ranks with sends that do not wait (micro-batches in flight), so this checks that a dead
stage is still noticed: killing node 1's rank makes both nodes exit with an error, bounded by a
generous limit (a hang detector, not a timing assertion).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import Server, free_port, launch  # noqa: E402
from test_server_e2e_parallel import _EXIT_LIMIT_S, _launch_node1, _ranks  # noqa: E402

from engine.testing.checkpoints import hf_greedy, load_hf_model  # noqa: E402

PROMPT = [1, 5, 9, 200, 31, 77, 1024]


def _pp_args(dist_port: int, node_rank: int) -> list[str]:
    return ["--pp-size", "2", "--nnodes", "2", "--node-rank", str(node_rank),
            "--dist-init-addr", f"127.0.0.1:{dist_port}", "--dist-timeout-s", "60"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Iterator[tuple[Server, Server]]:
    logs = str(tmp_path_factory.mktemp("pp-two-node-logs"))
    dist_port = free_port()
    node0 = launch(llama_ckpt_dir, logs, *_pp_args(dist_port, 0), api_key=None)
    node1 = _launch_node1(llama_ckpt_dir, logs, dist_port, _pp_args(dist_port, 1))
    try:
        node0.wait_ready()
        yield node0, node1
    finally:
        for node in (node0, node1):
            node.stop(signal.SIGKILL)


def test_pp_two_nodes_serve_then_a_dead_stage_stops_both(nodes: tuple[Server, Server], llama_ckpt_dir: str) -> None:
    node0, node1 = nodes
    r = node0.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(load_hf_model(llama_ckpt_dir), PROMPT, 8)
    assert node0.get("/get_server_info").json()["pp_micro_batches"] > 0
    (rank1,) = _ranks(node1)
    os.kill(rank1, signal.SIGKILL)
    assert node1.proc.wait(_EXIT_LIMIT_S) == 1
    assert node0.proc.wait(_EXIT_LIMIT_S) == 1
    log0 = node0.log()
    assert "another rank has exited" in log0 and "the server exits" in log0
