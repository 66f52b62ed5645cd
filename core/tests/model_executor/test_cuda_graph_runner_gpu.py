"""Decode graphs on a CUDA GPU with the shared logits buffer of the large graphs.

Graphs above ``OWN_LOGITS_MAX_BS`` rows have the model's ``LogitsProcessor`` write their logits
into one buffer they share (``decode_out``). With the threshold lowered to 2, a run whose batch shrinks
from 7 rows (bucket 8) through 4 to 1 replays shared-buffer graphs and own-output graphs in turn;
its greedy tokens equal the run with graphs off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.model_executor import cuda_graph_runner
from engine.testing.harness import OutputCollector, make_scheduler, submit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("graphs_gpu")), "LlamaForCausalLM", dtype="bfloat16",
                                hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def _run(sched: Any) -> list[list[int]]:
    # Different lengths: the running batch shrinks step by step across the buckets 8, 4, 2, 1.
    prompts = [list(range(3 + 5 * i, 20 + 5 * i)) for i in range(7)]
    col = OutputCollector()
    rids = [submit(sched, p, {"max_new_tokens": 4 + 3 * i, "temperature": 0, "ignore_eos": True})
            for i, p in enumerate(prompts)]
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    return [col.ids[r] for r in rids]


def test_shared_logits_graphs_equal_eager(ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graph_runner, "OWN_LOGITS_MAX_BS", 2)
    common = dict(platform="cuda", dtype="bfloat16", attention="triton", max_total_tokens=4096)
    sched = make_scheduler(ckpt, cuda_graph_max_bs=8, **common)
    graphs = sched.runner.cuda_graph_runner
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8]
    shared = graphs._shared_logits
    assert shared is not None and shared.shape[0] == 8
    for bs in (4, 8):  # the shared buffer's rows
        assert graphs.outputs[bs].data_ptr() == shared.data_ptr()
    for bs in (1, 2):  # their own tensors, apart from it
        assert graphs.outputs[bs].data_ptr() != shared.data_ptr()
    eager = make_scheduler(ckpt, disable_cuda_graph=True, **common)
    assert _run(sched) == _run(eager)
