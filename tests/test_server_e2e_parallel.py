"""End to end: a tensor-parallel server over two "nodes" on one machine (CPU, gloo).

Node 0 (``--node-rank 0``) runs the HTTP server and rank 0; node 1 runs only rank 1. Both meet
at ``--dist-init-addr 127.0.0.1:PORT``. Then one rank is killed: both nodes must exit with an
error, bounded by a generous limit (a hang detector, not a timing assertion).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import Server, free_port, launch  # noqa: E402

from engine.testing.checkpoints import hf_greedy, load_hf_model  # noqa: E402

_EXIT_LIMIT_S = 60.0
PROMPT = [1, 5, 9, 200, 31, 77, 1024]


def _node_args(dist_port: int, node_rank: int, *extra: str) -> list[str]:
    return ["--tp-size", "2", "--nnodes", "2", "--node-rank", str(node_rank),
            "--dist-init-addr", f"127.0.0.1:{dist_port}", "--dist-timeout-s", "60", *extra]


def _launch_node1(ckpt: str, log_dir: str, dist_port: int, node_args: list[str] | None = None) -> Server:
    cmd = [sys.executable, "-m", "engine", "serve", "--model-path", ckpt, "--max-total-tokens", "32768",
           *(node_args or _node_args(dist_port, 1))]
    log_path = os.path.join(log_dir, "node1.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Server(proc, 0, log_path, None)


def _ranks(node: Server) -> list[int]:
    out = []
    for pid in node.descendants():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"engine.entrypoints.child_process" in f.read():
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Iterator[tuple[Server, Server]]:
    logs = str(tmp_path_factory.mktemp("two-node-logs"))
    dist_port = free_port()
    node0 = launch(llama_ckpt_dir, logs, *_node_args(dist_port, 0), api_key=None)
    node1 = _launch_node1(llama_ckpt_dir, logs, dist_port)
    try:
        node0.wait_ready()
        yield node0, node1
    finally:
        for node in (node0, node1):
            node.stop(signal.SIGKILL)


def test_two_nodes_serve_greedy_equal_to_transformers(nodes: tuple[Server, Server], llama_ckpt_dir: str) -> None:
    node0, node1 = nodes
    r = node0.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(load_hf_model(llama_ckpt_dir), PROMPT, 8)
    info: dict[str, Any] = node0.get("/get_server_info").json()
    assert info["tp_size"] == 2 and info["nnodes"] == 2
    assert node1.proc.poll() is None and "1 rank(s) ready" in node1.log()


def test_killing_a_rank_stops_both_nodes_with_a_clear_error(nodes: tuple[Server, Server]) -> None:
    node0, node1 = nodes
    (rank1,) = _ranks(node1)
    os.kill(rank1, signal.SIGKILL)
    assert node1.proc.wait(_EXIT_LIMIT_S) == 1
    assert node0.proc.wait(_EXIT_LIMIT_S) == 1
    assert "exited (exit code -9); stopping this node's ranks" in node1.log()
    log0 = node0.log()
    assert "another rank has exited" in log0 and "the server exits" in log0
    assert not [pid for pid in _ranks(node0) if os.path.exists(f"/proc/{pid}")]


def test_a_node_that_never_joins_fails_start_up_with_a_clear_error(tmp_path: Any, llama_ckpt_dir: str) -> None:
    node0 = launch(llama_ckpt_dir, str(tmp_path), *_node_args(free_port(), 0)[:-2], "--dist-timeout-s", "3",
                   api_key=None)
    try:
        code = node0.proc.wait(_EXIT_LIMIT_S + 60)
    finally:
        node0.stop(signal.SIGKILL)
    assert code != 0
    assert "the 2 ranks did not all join at tcp://127.0.0.1:" in node0.log()
    assert "within 3 s (--dist-timeout-s)" in node0.log()
