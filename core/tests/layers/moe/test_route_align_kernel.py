"""The one-launch router + alignment (``route_and_align_triton``) against the separate torch steps
(``route_and_align`` on CPU tensors: ``select_experts_reference``, the local-id mapping,
``align_slots_reference``): ids and blocks entry for entry, weights within float32 rounding.

Runs on the GPU (marked gpu) and, without one, under Triton's interpreter on the CPU (see
conftest.py). Routings: one token (most experts get nothing), batches whose token count or top-k
is no power of two (padding rows and lanes in the tile), every expert busy, this rank holding a
slice of the experts (the others' slots go to the ``-1`` group), renormalised or not.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe.align import ExpertBlocks
from engine.layers.moe.route_align import (
    ROUTE_ALIGN_MAX_LOGITS,
    ROUTE_ALIGN_MAX_SLOTS,
    ROUTE_ALIGN_PAYS_MAX_SLOTS,
    route_align_applies,
    route_align_fits,
    route_and_align,
    to_local_expert_ids,
)
from engine.layers.moe.route_align_kernel import route_and_align_triton


def _logits(tokens: int, experts: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 3


def _assert_same(ours: tuple[torch.Tensor, torch.Tensor, ExpertBlocks],
                 ref: tuple[torch.Tensor, torch.Tensor, ExpertBlocks]) -> None:
    (w, ids, blocks), (ref_w, ref_ids, ref_blocks) = ours, ref
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == ref_ids.shape
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w, atol=1e-6, rtol=1e-5)
    assert (blocks.num_slots, blocks.block_m) == (ref_blocks.num_slots, ref_blocks.block_m)
    assert torch.equal(blocks.num_padded.cpu(), ref_blocks.num_padded)
    assert torch.equal(blocks.sorted_slot_ids.cpu(), ref_blocks.sorted_slot_ids)
    assert torch.equal(blocks.block_expert_ids.cpu(), ref_blocks.block_expert_ids)


@pytest.mark.parametrize("tokens, experts, top_k, block_m", [
    (1, 128, 8, 16),   # Qwen3-30B-A3B decode at batch 1
    (1, 8, 2, 16),     # Mixtral-like
    (3, 60, 4, 16),    # Qwen2-MoE-like; 3 tokens: a padding row in the tile
    (5, 8, 3, 4),      # top 3: a padding lane per row
    (8, 8, 8, 16),     # every expert takes every token
    (64, 128, 8, 16),  # the largest decode batch the kernel takes
], ids=lambda v: str(v))
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_the_separate_steps(triton_device: str, tokens: int, experts: int, top_k: int, block_m: int,
                                    renormalize: bool) -> None:
    logits = _logits(tokens, experts, seed=tokens * 100 + experts)
    _assert_same(route_and_align_triton(logits.to(triton_device), top_k, renormalize, block_m),
                 route_and_align(logits, top_k, renormalize, block_m))


@pytest.mark.parametrize("expert_start, num_local", [(0, 4), (4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_expert_parallel_ranks(triton_device: str, tokens: int, expert_start: int, num_local: int) -> None:
    """A rank holding experts [start, start + num_local) of 8: ids local, the rest -1 and grouped."""
    logits = _logits(tokens, 8, seed=tokens + expert_start)
    ours = route_and_align_triton(logits.to(triton_device), 2, True, 16, expert_start, num_local)
    ref = route_and_align(logits, 2, True, 16, expert_start, num_local)
    _assert_same(ours, ref)
    global_ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices
    assert torch.equal(ref[1], to_local_expert_ids(global_ids, expert_start, num_local).to(torch.int32))


def test_16_bit_and_strided_logits(triton_device: str) -> None:
    """Logits in the activation dtype, and a column slice of a wider tensor (row stride != E)."""
    dtype = torch.bfloat16 if triton_device == "cuda" else torch.float16
    wide = _logits(6, 40, seed=3).to(dtype)
    logits = wide[:, 4:36]
    _assert_same(route_and_align_triton(logits.to(triton_device), 4, True, 16),
                 route_and_align(logits, 4, True, 16))


def test_the_batches_it_takes() -> None:
    assert route_align_fits(1, 128, 8, 16) and route_align_fits(64, 128, 8, 16)
    assert not route_align_fits(65, 128, 8, 16)   # 520 slots
    assert not route_align_fits(64, 256, 8, 16)   # 16384 logits
    assert not route_align_fits(1, 8, 2, 24)      # BLOCK_M no power of two
    assert not route_align_fits(0, 8, 2, 16)
    assert ROUTE_ALIGN_MAX_SLOTS == 512 and ROUTE_ALIGN_MAX_LOGITS == 8192
    # Taken by default only where it is not slower than the two launches (H100 timings).
    assert route_align_applies(4, 128, 8, 16) and route_align_applies(16, 8, 2, 16)
    assert not route_align_applies(5, 128, 8, 16) and not route_align_applies(64, 128, 8, 16)
    assert not route_align_applies(0, 8, 2, 16) and not route_align_applies(1, 8, 2, 24)
    assert ROUTE_ALIGN_PAYS_MAX_SLOTS == 32


def test_bad_arguments_are_refused(triton_device: str) -> None:
    logits = torch.zeros(2, 8, device=triton_device)
    with pytest.raises(ValueError, match="top_k 9 out of range for 8 experts"):
        route_and_align_triton(logits, 9, True, 16)
    with pytest.raises(ValueError, match=r"local experts \[6, 10\) out of range for 8 experts"):
        route_and_align_triton(logits, 2, True, 16, expert_start=6, num_local_experts=4)
    with pytest.raises(ValueError, match="block_m 24"):
        route_and_align_triton(logits, 2, True, 24)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 4, 64, 65])  # the kernel; past ROUTE_ALIGN_PAYS_MAX_SLOTS, the separate kernels
def test_route_and_align_on_cuda(tokens: int) -> None:
    logits = _logits(tokens, 128, seed=tokens)
    _assert_same(route_and_align(logits.cuda(), 8, True, 16, 32, 64), route_and_align(logits, 8, True, 16, 32, 64))
