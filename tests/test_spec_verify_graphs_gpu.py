"""Speculative verify steps under CUDA graphs (run by the lead on a GPU): on a tiny float32
checkpoint with the triton backend, verify steps replayed from graphs give the same greedy output
as eager verify steps (--disable-cuda-graph) and as speculation off, with ngram drafts, random
drafts of every length (rows padded to k + 1) and odd batch sizes (padded to a bucket); no KV
leaks. The real default model's hash check is ``engine bench spec`` (docs/speculative.md)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.testing.harness import generate_greedy, make_scheduler
from engine.testing.proposers import RandomProposer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("verify_graphs")), "LlamaForCausalLM", **_SHAPE)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    phrase = [rng.randrange(1000) for _ in range(20)]
    return [phrase * 4, [rng.randrange(1000) for _ in range(9)], phrase[:7] * 6 + [1, 2, 3],
            [rng.randrange(1000) for _ in range(150)], phrase * 2 + phrase[:10]]


def _sched(ckpt: str, **kw: Any) -> Any:
    # float32 (CUDA's --dtype auto is bfloat16): equality with plain decoding is exact only there.
    return make_scheduler(ckpt, platform="cuda", attention="triton", dtype="float32", max_total_tokens=20000, **kw)


@pytest.fixture(scope="module")
def plain(ckpt: str, prompts: list[list[int]]) -> list[list[int]]:
    return generate_greedy(_sched(ckpt), prompts, 40)


@pytest.mark.parametrize("k", [3, 6])
def test_graph_verify_equals_eager_verify_and_plain(ckpt: str, prompts: list[list[int]], plain: list[list[int]],
                                                    k: int) -> None:
    graphs_on = _sched(ckpt, speculative_algorithm="ngram", speculative_num_steps=k)
    graphs = graphs_on.speculator.verify_graphs
    assert graphs is not None and graphs.tokens_per_row == k + 1
    eager = _sched(ckpt, speculative_algorithm="ngram", speculative_num_steps=k, disable_cuda_graph=True)
    assert eager.speculator.verify_graphs is None
    for batch in (prompts, prompts[:3], prompts[:1]):  # 5 and 3 rows pad to buckets 8 and 4
        want = [plain[prompts.index(p)] for p in batch]
        assert generate_greedy(graphs_on, batch, 40) == want
        assert generate_greedy(eager, batch, 40) == want
    assert graphs.replays > 0 and graphs_on.speculator.stats.accepted_tokens > 0
    check_no_leak(graphs_on)
    check_no_leak(eager)


def test_graph_verify_random_drafts_exact(ckpt: str, prompts: list[list[int]], plain: list[list[int]]) -> None:
    sched = _sched(ckpt, speculative_algorithm="ngram", speculative_num_steps=5)
    sched.speculator.proposer = RandomProposer(2, vocab=1000)
    assert generate_greedy(sched, prompts, 40) == plain
    assert sched.speculator.verify_graphs.replays > 0
    check_no_leak(sched)


def test_graph_verify_sampling_runs_and_frees_kv(ckpt: str, prompts: list[list[int]]) -> None:
    from engine.testing.harness import OutputCollector, submit

    sched = _sched(ckpt, speculative_algorithm="ngram", speculative_num_steps=4)
    rids = [submit(sched, p, {"max_new_tokens": 30, "temperature": 0.8, "top_p": 0.9}) for p in prompts]
    col = OutputCollector()
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    assert all(len(col.ids[r]) == 30 for r in rids)
    check_no_leak(sched)
