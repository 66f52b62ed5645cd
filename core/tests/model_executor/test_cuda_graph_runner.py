"""``CudaGraphRunner`` on the CPU: the static inputs of decode graphs and their one-copy refresh.

The CPU has no device graphs, so ``engine.testing.graphs.EagerReplayGraphs`` "replays" a bucket by
running the model on that bucket's static batch (what a graph does with the buffers as they are at
replay time). That
checks the static buffers: the rows of ``ForwardBatch.decode_ints`` copied in one go, the
field-by-field copy for batches built otherwise, and padded rows reset to the padding values.
The real capture is checked on the GPU by the model tests with graphs on.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.model_executor import cuda_graph_runner
from engine.testing.graphs import EagerReplayGraphs
from engine.testing.harness import generate_greedy, make_scheduler


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2048) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def test_graph_replays_equal_eager_decoding(llama_ckpt: str, monkeypatch: Any) -> None:
    """Batches of 1, 3 (padded to 4) and 5 rows (over the largest bucket: eager) decode as with no
    graphs; every replayed batch came from prepare_for_decode and took the one-copy path."""
    packed = []
    real = cuda_graph_runner._decode_ints
    monkeypatch.setattr(cuda_graph_runner, "_decode_ints", lambda fb: packed.append(real(fb)) or packed[-1])
    for n in (1, 3, 5):
        prompts = _prompts(n, seed=n)
        expected = generate_greedy(make_scheduler(llama_ckpt), prompts, 12)
        sched = make_scheduler(llama_ckpt)
        graphs = sched.runner.cuda_graph_runner = EagerReplayGraphs(sched.runner, 4)
        assert generate_greedy(sched, prompts, 12) == expected
        assert len(graphs.seen) == (11 if n <= 4 else 0)
    assert packed and all(p is not None for p in packed)


def test_padded_rows_get_the_padding_values(llama_ckpt: str) -> None:
    """After 4-row steps, 3-row steps replay the 4-row graph with row 3 reset: slot 0, position 0,
    the backend's fill length, KV slot 0."""
    sched = make_scheduler(llama_ckpt)
    graphs = sched.runner.cuda_graph_runner = EagerReplayGraphs(sched.runner, 4)
    prompts = _prompts(4, seed=3)
    generate_greedy(sched, prompts, 3)
    generate_greedy(sched, prompts[:3], 3)
    last = graphs.seen[-1]
    assert last.shape == (4, 4)
    assert last[:, 3].tolist() == [0, 0, graphs.fill_seq_len, 0]
    assert (last[2, :3] == last[1, :3] + 1).all() and (last[3, :3] > 0).all()


def test_a_replaced_field_falls_back_to_field_copies(llama_ckpt: str) -> None:
    """A batch whose positions were replaced after prepare_for_decode is not copied from its stale
    ``decode_ints``: each field is copied as given."""
    sched = make_scheduler(llama_ckpt)
    graphs = EagerReplayGraphs(sched.runner, 2)
    fb = SimpleNamespace(batch_size=2, decode_ints=torch.arange(8).view(4, 2), input_ids=torch.tensor([5, 6]),
                         seq_lens_cpu=[4, 5])
    fb.req_pool_indices, fb.positions, fb.seq_lens, fb.out_cache_loc = fb.decode_ints.unbind(0)
    assert cuda_graph_runner._decode_ints(fb) is fb.decode_ints
    fb.positions = torch.tensor([40, 41])
    assert cuda_graph_runner._decode_ints(fb) is None
    graphs.graphs[2] = SimpleNamespace(replay=lambda: graphs.seen.append(graphs.ints[:, :2].clone()))
    graphs.replay(fb)
    assert graphs.seen[-1].tolist() == [[0, 1], [40, 41], [4, 5], [6, 7]]


def test_logits_into_sets_decode_out_for_the_capture_only() -> None:
    """``_logits_into`` points every LogitsProcessor of the model at the shared buffer's rows while
    a shared-buffer graph is captured, and resets them after (also when the capture fails)."""
    from engine.layers.logits_processor import LogitsProcessor

    model = torch.nn.Module()
    model.head = LogitsProcessor(10)
    model.inner = torch.nn.Sequential(LogitsProcessor(10))
    procs = [model.head, model.inner[0]]
    target = torch.empty(4, 10)
    with cuda_graph_runner._logits_into(model, target):
        assert all(p.decode_out is target for p in procs)
    assert all(p.decode_out is None for p in procs)
    with pytest.raises(RuntimeError, match="capture failed"), cuda_graph_runner._logits_into(model, target):
        raise RuntimeError("capture failed")
    assert all(p.decode_out is None for p in procs)
    with cuda_graph_runner._logits_into(model, None):  # a graph with its own logits
        assert all(p.decode_out is None for p in procs)
