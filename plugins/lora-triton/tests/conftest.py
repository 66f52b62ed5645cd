"""Fixtures shared by the triton LoRA backend's tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.lora.backend import LoraBatchInfo


def make_batch_info(lens: list[int], slots: list[int], ranks: list[int], device: str = "cpu",
                    max_seg_len: int | None = None) -> LoraBatchInfo:
    """A batch of segments of ``lens`` tokens on ``slots``, over pool slots of ``ranks``, with
    scalings drawn from ``device``'s generator in [0.5, 1.5); ``max_seg_len`` defaults to the
    longest segment (a larger one: an upper bound, as a captured graph's)."""
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return LoraBatchInfo(num_segments=len(lens), seg_indptr=indptr.to(device),
                         weight_indices=torch.tensor(slots, dtype=torch.int32, device=device),
                         lora_ranks=torch.tensor(ranks, dtype=torch.int32, device=device),
                         scalings=torch.rand(len(ranks), device=device) + 0.5,
                         max_seg_len=max(lens) if max_seg_len is None else max_seg_len)


@pytest.fixture
def batch_info() -> Callable[..., LoraBatchInfo]:
    """``make_batch_info``: the tests' LoRA batch of segments."""
    return make_batch_info
