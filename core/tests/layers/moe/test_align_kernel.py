"""The one-launch slot alignment against the torch one (``align_slots_reference``), entry for entry.

Runs on the GPU (marked gpu) and, without one, under Triton's interpreter on the CPU (see
conftest.py). Routings: random top-k (distinct experts per token, as the router gives), some
slots held by another expert-parallel rank (``-1``), all of them held elsewhere, every slot on
one expert (a run of several blocks), one token, and batches of several 64-slot chunks. The chunked launches (batches past the
one-program kernel's cap) against it too, with small chunks so that many of them (and partial
last chunks, and runs spanning chunks) are covered without large batches in the interpreter.
Batches of more than ``INTERPRETER_MAX_SLOTS`` slots run on a GPU only: in the interpreter each
takes 15-55 s, and the smaller cases walk the same chunk loops.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe.align import (
    ALIGN_KERNEL_MAX_SLOTS,
    ExpertBlocks,
    align_slots_by_expert,
    align_slots_reference,
    kernel_can_align,
)
from engine.layers.moe.align_kernel import align_slots_chunked, align_slots_triton

INTERPRETER_MAX_SLOTS = 600


def _gpu_only_if_large(device: str, slots: int) -> None:
    if device == "cpu" and slots > INTERPRETER_MAX_SLOTS:
        pytest.skip(f"{slots} slots run on a GPU only (Triton's interpreter takes too long)")


def _routing(tokens: int, top_k: int, experts: int, seed: int, elsewhere: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    held_elsewhere = torch.rand(tokens, top_k, generator=gen) < elsewhere
    return torch.where(held_elsewhere, torch.full_like(ids, -1), ids)


def _assert_same(ours: ExpertBlocks, ref: ExpertBlocks) -> None:
    assert ours.num_slots == ref.num_slots and ours.block_m == ref.block_m
    assert torch.equal(ours.num_padded.cpu(), ref.num_padded)
    assert torch.equal(ours.sorted_slot_ids.cpu(), ref.sorted_slot_ids)
    assert torch.equal(ours.block_expert_ids.cpu(), ref.block_expert_ids)
    assert ours.sorted_slot_ids.dtype == ours.block_expert_ids.dtype == ours.num_padded.dtype == torch.int32


@pytest.mark.parametrize("tokens, top_k, experts, block_m", [
    (1, 8, 128, 16),   # Qwen3-30B-A3B decode at batch 1: 120 experts get nothing
    (1, 2, 8, 16),     # Mixtral-like
    (3, 2, 4, 4),
    (7, 8, 8, 16),     # every expert busy
    (64, 8, 128, 16),  # 512 slots: eight chunks
    (300, 8, 128, 32),  # 2400 slots
    (5, 8, 127, 64),   # 128 bins (127 experts + elsewhere): no spare lane past the last bin
], ids=lambda v: str(v))
@pytest.mark.parametrize("elsewhere", [0.0, 0.3], ids=["all-local", "ep"])
def test_matches_torch_alignment(triton_device: str, tokens: int, top_k: int, experts: int, block_m: int,
                                 elsewhere: float) -> None:
    _gpu_only_if_large(triton_device, tokens * top_k)
    ids = _routing(tokens, top_k, experts, seed=tokens + experts, elsewhere=elsewhere)
    _assert_same(align_slots_triton(ids.to(triton_device), experts, block_m),
                 align_slots_reference(ids, experts, block_m))


def test_one_expert_and_all_elsewhere(triton_device: str) -> None:
    one = torch.zeros(40, 1, dtype=torch.int32)  # expert 0: 40 slots, three 16-blocks
    _assert_same(align_slots_triton(one.to(triton_device), 8, 16), align_slots_reference(one, 8, 16))
    gone = torch.full((6, 2), -1, dtype=torch.int32)
    ours = align_slots_triton(gone.to(triton_device), 8, 16)
    _assert_same(ours, align_slots_reference(gone, 8, 16))
    assert ours.block_expert_ids.tolist() == [-1] * ours.block_expert_ids.numel()


def test_int64_ids_and_the_worked_example(triton_device: str) -> None:
    """The example of test_moe_kernel.py, from int64 ids (what ``torch.topk`` gives)."""
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]], dtype=torch.int64)
    ours = align_slots_triton(ids.to(triton_device), 4, block_m=4)
    assert int(ours.num_padded.item()) == 12
    assert ours.sorted_slot_ids.tolist()[:12] == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]
    _assert_same(ours, align_slots_reference(ids, 4, 4))


def test_batches_the_kernel_takes() -> None:
    assert kernel_can_align(8, 16) and kernel_can_align(ALIGN_KERNEL_MAX_SLOTS, 64)
    assert not kernel_can_align(ALIGN_KERNEL_MAX_SLOTS + 1, 16)
    assert not kernel_can_align(0, 16) and not kernel_can_align(8, 24)
    with pytest.raises(ValueError, match="24"):
        align_slots_triton(torch.zeros(2, 4, dtype=torch.int32), 4, 24)


@pytest.mark.parametrize("tokens, top_k, experts, block_m, chunk", [
    (1, 8, 128, 16, 16),      # one partial chunk
    (37, 8, 128, 64, 16),     # 296 slots: 19 chunks, the last partial
    (64, 8, 128, 128, 256),   # prefill tiles: 128-slot blocks, two chunks
    (50, 2, 8, 32, 8),        # few experts: long runs spanning many chunks
    (9, 8, 127, 16, 32),      # 128 bins (127 experts + elsewhere)
    (600, 8, 128, 16, 1024),  # past the one-program cap, the default chunk
], ids=lambda v: str(v))
@pytest.mark.parametrize("elsewhere", [0.0, 0.3], ids=["all-local", "ep"])
def test_chunked_matches_torch_alignment(triton_device: str, tokens: int, top_k: int, experts: int, block_m: int,
                                         chunk: int, elsewhere: float) -> None:
    _gpu_only_if_large(triton_device, tokens * top_k)
    ids = _routing(tokens, top_k, experts, seed=tokens * 7 + experts, elsewhere=elsewhere)
    _assert_same(align_slots_chunked(ids.to(triton_device), experts, block_m, chunk=chunk),
                 align_slots_reference(ids, experts, block_m))


def test_chunked_one_expert_all_elsewhere_and_bad_sizes(triton_device: str) -> None:
    one = torch.zeros(40, 1, dtype=torch.int32)
    _assert_same(align_slots_chunked(one.to(triton_device), 8, 16, chunk=8), align_slots_reference(one, 8, 16))
    gone = torch.full((6, 2), -1, dtype=torch.int64)
    ours = align_slots_chunked(gone.to(triton_device), 8, 16, chunk=4)
    _assert_same(ours, align_slots_reference(gone, 8, 16))
    assert ours.block_expert_ids.tolist() == [-1] * ours.block_expert_ids.numel()
    for bad in ({"block_m": 24}, {"chunk": 100}):
        with pytest.raises(ValueError, match="power-of-two"):
            align_slots_chunked(one.to(triton_device), 8, **{"block_m": 16, "chunk": 8, **bad})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 600, 9000])  # the one-program kernel; past its cap, the chunked ones
def test_align_slots_by_expert_on_cuda(tokens: int) -> None:
    ids = _routing(tokens, 8, 128, seed=tokens, elsewhere=0.2)
    _assert_same(align_slots_by_expert(ids.cuda(), 128, 16), align_slots_reference(ids, 128, 16))
