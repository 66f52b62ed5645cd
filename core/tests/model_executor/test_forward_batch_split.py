"""ForwardBatch.split_rows: pipeline micro-batches of consecutive rows."""

from __future__ import annotations

import torch

from engine.model_executor.forward_batch import ForwardBatch, ForwardMode


def _extend_batch() -> ForwardBatch:
    # Three rows: 2 new tokens on a prefix of 1, 3 new on none, 1 new on a prefix of 4.
    return ForwardBatch.build(ForwardMode.EXTEND, input_ids=[10, 11, 20, 21, 22, 30], req_pool_indices=[5, 6, 7],
                              seq_lens=[3, 3, 5], prefix_lens=[1, 0, 4],
                              out_cache_loc=torch.tensor([100, 101, 200, 201, 202, 300]), device="cpu")


def test_extend_rows_split_with_their_tokens() -> None:
    first, second = _extend_batch().split_rows(2)
    assert first.batch_size == 1 and second.batch_size == 2
    assert first.input_ids.tolist() == [10, 11] and second.input_ids.tolist() == [20, 21, 22, 30]
    assert second.out_cache_loc.tolist() == [200, 201, 202, 300]
    assert second.positions.tolist() == [0, 1, 2, 4]
    assert second.extend_start_loc.tolist() == [0, 3]
    assert second.extend_prefix_lens_cpu == [0, 4] and second.seq_lens_cpu == [3, 5] and second.seq_lens_sum == 8
    assert second.req_pool_indices.tolist() == [6, 7]


def test_decode_rows_split_evenly_and_never_empty() -> None:
    fb = ForwardBatch.build(ForwardMode.DECODE, input_ids=[1, 2, 3], req_pool_indices=[0, 1, 2], seq_lens=[4, 5, 6],
                            prefix_lens=[3, 4, 5], out_cache_loc=torch.tensor([7, 8, 9]), device="cpu")
    parts = fb.split_rows(4)
    assert [p.input_ids.tolist() for p in parts] == [[1], [2], [3]]
    assert fb.split_rows(1) == [fb]
