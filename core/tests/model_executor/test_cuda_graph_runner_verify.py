"""``VerifyGraphRunner`` on the CPU: the static-buffer plumbing of captured verify steps.

The CPU has no device graphs, so a subclass "replays" by running the model again on the same
static ``ForwardBatch`` (what a graph would do with the buffers as they are at replay time).
That checks everything but the capture itself: rows padded to ``k + 1`` tokens and batches to
a bucket, positions, KV slots (padding to slot 0), ``req_to_token``, the row-major logits and
the single-sync verification. Outputs must equal speculation off with any proposer, with rows
that do not draft beside drafting rows, and no KV may leak. The real capture is checked on the
GPU by tests/test_spec_verify_graphs_gpu.py.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.model_executor.cuda_graph_runner import VerifyGraphRunner
from engine.model_executor.forward_batch import ForwardBatch
from engine.speculative import Proposer
from engine.testing.harness import OutputCollector, generate_greedy, make_scheduler, submit
from engine.testing.proposers import OracleProposer, RandomProposer


class EagerReplayRunner(VerifyGraphRunner):
    """Capture runs the model once; a replay runs it again on the static batch."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.launches: list[int] = []
        super().__init__(*args, **kw)

    def _capture(self, bs: int, fb: ForwardBatch, stream: Any) -> Any:
        return self.runner.model(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def _launch(self, bs: int) -> None:
        fb = self.batches[bs]
        out = self.runner.model(fb.input_ids, fb.positions, fb)
        self.outputs[bs].full_logits.copy_(out.full_logits)
        self.launches.append(bs)


def _give_verify_mode(backend: Any) -> None:
    """The torch-native backend plans nothing for extend batches: its verify mode is trivial
    (it reads the static batch's host lists, which the runner refreshes before each replay)."""
    backend.supports_verify_cuda_graph = True
    backend.init_verify_cuda_graph_state = lambda max_bs, tokens: None
    backend.init_forward_metadata_capture_verify = backend.init_forward_metadata
    backend.init_forward_metadata_replay_verify = backend.init_forward_metadata


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    phrase = [rng.randrange(2048) for _ in range(12)]
    return [phrase * 3, [rng.randrange(2048) for _ in range(7)], [rng.randrange(2048) for _ in range(40)],
            phrase[:5] + [9, 8] * 5, [rng.randrange(2048) for _ in range(21)]]


@pytest.fixture(scope="module")
def expected(llama_ckpt: str, prompts: list[list[int]]) -> list[list[int]]:
    return generate_greedy(make_scheduler(llama_ckpt), prompts, 24)


def _spec(path: str, proposer: Proposer, k: int, graph_bs: int, **kw: Any) -> tuple[Any, EagerReplayRunner]:
    sched = make_scheduler(path, speculative_algorithm="ngram", speculative_num_steps=k, **kw)
    assert sched.speculator.verify_graphs is None  # no device graphs on the CPU
    sched.speculator.proposer = proposer
    _give_verify_mode(sched.runner.attn_backend)
    graphs = EagerReplayRunner(sched.runner, k + 1, graph_bs)
    sched.speculator.verify_graphs = graphs
    return sched, graphs


def test_padded_verify_steps_equal_plain_decoding(llama_ckpt: str, prompts: list[list[int]],
                                                  expected: list[list[int]]) -> None:
    # Graphs for up to 2 rows: the 5-row batch verifies eagerly, smaller ones replay.
    sched, graphs = _spec(llama_ckpt, RandomProposer(3), k=4, graph_bs=2)
    assert graphs.batch_sizes == [1, 2]
    assert generate_greedy(sched, prompts, 24) == expected  # 5 rows: eager verify
    for p, e in zip(prompts[:3], expected[:3]):  # 1 row, then 2 rows (padded from 1 at the end)
        assert generate_greedy(sched, [p], 24) == [e]
    assert generate_greedy(sched, prompts[3:], 24) == expected[3:]
    assert set(graphs.launches) == {1, 2}
    check_no_leak(sched)


def test_odd_batch_pads_to_bucket_and_oracle_accepted_in_full(llama_ckpt: str, prompts: list[list[int]],
                                                              expected: list[list[int]]) -> None:
    k = 3
    sched, graphs = _spec(llama_ckpt, OracleProposer(prompts, expected), k=k, graph_bs=8)
    assert graphs.batch_sizes == [1, 2, 4, 8]
    assert generate_greedy(sched, prompts[:3], 24) == expected[:3]  # 3 rows run in the 4-row graph
    st = sched.speculator.stats
    assert st.accepted_tokens == st.proposed_tokens > 0
    assert 4 in graphs.launches
    # Positions past a row's drafts were written to slot 0 and freed nowhere: no leak.
    check_no_leak(sched)


def test_rows_without_drafts_sample_from_their_real_last_position(llama_ckpt: str, prompts: list[list[int]],
                                                                  expected: list[list[int]]) -> None:
    """A penalized row and a logprob row take the sampler's token; in the padded layout their
    logits come from position 0 of their row, not from the padding."""
    sched, graphs = _spec(llama_ckpt, OracleProposer(prompts, expected), k=4, graph_bs=4)
    plain = make_scheduler(llama_ckpt)

    def run(s: Any) -> list[list[int]]:
        params = [{"frequency_penalty": 0.6}, {}, {}, {"repetition_penalty": 1.2}]
        rids = [submit(s, p, {"max_new_tokens": 20, "temperature": 0.0, **x}, return_logprob=(i == 2))
                for i, (p, x) in enumerate(zip(prompts[:4], params))]
        col = OutputCollector()
        while s.step():
            col.collect(s)
        col.collect(s)
        return [col.ids[r] for r in rids]

    assert run(sched) == run(plain)
    assert graphs.launches and sched.speculator.stats.accepted_tokens > 0
    check_no_leak(sched)


def test_rows_near_the_context_end_verify_eagerly(llama_ckpt: str) -> None:
    sched, graphs = _spec(llama_ckpt, RandomProposer(0), k=4, graph_bs=2)
    assert graphs.can_run(1, graphs.context_len - 5)
    assert not graphs.can_run(1, graphs.context_len - 4)
    assert not graphs.can_run(3, 10) and not graphs.can_run(0, 10)


def test_replay_lays_out_static_buffers(llama_ckpt: str) -> None:
    sched, graphs = _spec(llama_ckpt, RandomProposer(0), k=2, graph_bs=4)
    pool = sched.req_to_token_pool
    slots = pool.alloc(2)
    locs = torch.tensor([101, 102, 201], dtype=torch.int64)
    out, fb = graphs.replay(slots, [5, 9], [[7, 8], [6]], locs)
    assert fb.batch_size == 2 and graphs.launches == [2]
    assert graphs.input_ids[:6].tolist() == [7, 8, 0, 6, 0, 0]
    assert graphs.positions[:6].tolist() == [5, 6, 7, 9, 10, 11]
    assert graphs.out_cache_loc[:6].tolist() == [101, 102, 0, 201, 0, 0]
    assert graphs.prefix_lens[:2].tolist() == [5, 9] and graphs.seq_lens[:2].tolist() == [8, 12]
    assert pool.req_to_token[slots[0], 5:8].tolist() == [101, 102, 0]
    assert pool.req_to_token[slots[1], 9:12].tolist() == [201, 0, 0]
    assert fb.extend_prefix_lens_cpu == [5, 9]
    full = out.full_logits
    assert torch.equal(out.next_token_logits, full[[1, 3]])  # rows' last real tokens
    pool.free(slots)
