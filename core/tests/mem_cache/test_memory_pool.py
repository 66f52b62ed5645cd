"""Page maths of the request and KV slot pools."""

from __future__ import annotations

import pytest
import torch

from engine.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator


def test_req_to_token_pool_alloc_free_write() -> None:
    pool = ReqToTokenPool(size=3, max_context_len=8, device="cpu")
    assert pool.req_to_token.dtype == torch.int32
    slots = pool.alloc(2)
    assert slots == [0, 1]
    assert pool.alloc(2) is None  # only one left; nothing taken
    assert pool.available_size() == 1
    pool.write(1, 2, torch.tensor([7, 8, 9], dtype=torch.int64))
    assert pool.req_to_token[1, :6].tolist() == [0, 0, 7, 8, 9, 0]
    pool.free(slots)
    pool.free(pool.alloc(1)[0])
    assert sorted(pool.free_slots) == [0, 1, 2]


def test_page1_alloc_hands_out_slots_from_one_and_free_returns_them() -> None:
    alloc = TokenToKVPoolAllocator(size=8, page_size=1)
    assert alloc.available_size() == 8
    first = alloc.alloc(5)
    assert first.tolist() == [1, 2, 3, 4, 5]  # slot 0 is the padding slot
    assert alloc.alloc(4) is None
    assert alloc.available_size() == 3
    alloc.free(first[1:3])
    assert alloc.available_size() == 5
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.available_size() == 5


def test_paged_alloc_gives_whole_pages_and_skips_page_zero() -> None:
    alloc = TokenToKVPoolAllocator(size=16, page_size=4)
    assert alloc.available_size() == 16
    out = alloc.alloc(8)
    assert out.tolist() == list(range(4, 12))  # pages 1 and 2
    with pytest.raises(AssertionError):
        alloc.alloc(3)
    assert alloc.alloc(12) is None
    assert alloc.available_size() == 8


def test_paged_free_frees_whole_page_once() -> None:
    alloc = TokenToKVPoolAllocator(size=16, page_size=4)
    out = alloc.alloc(8)
    assert out is not None
    # Two slots of the same page free that page once, not twice.
    alloc.free(out[[0, 2]])
    assert alloc.available_size() == 12
    assert alloc.free_pages.tolist().count(1) == 1


def test_size_is_truncated_to_whole_pages() -> None:
    alloc = TokenToKVPoolAllocator(size=18, page_size=4)
    assert alloc.size == 16
    assert alloc.available_size() == 16


def test_alloc_extend_continues_partial_page_then_takes_new_pages() -> None:
    ps = 4
    alloc = TokenToKVPoolAllocator(size=32, page_size=ps)
    first = alloc.alloc_extend([0], [6], [0])
    assert first is not None and len(first) == 6
    # Position p always sits at offset p % page_size of its page.
    assert [int(s) % ps for s in first] == [p % ps for p in range(6)]
    assert alloc.available_size() == 32 - 2 * ps
    second = alloc.alloc_extend([6], [11], [int(first[-1])])
    assert second is not None and len(second) == 5
    assert second[:2].tolist() == [int(first[-1]) + 1, int(first[-1]) + 2]
    assert [int(s) % ps for s in second] == [p % ps for p in range(6, 11)]
    assert alloc.available_size() == 32 - 3 * ps


def test_alloc_extend_batch_counts_pages_per_request() -> None:
    ps = 4
    alloc = TokenToKVPoolAllocator(size=32, page_size=ps)
    base = alloc.alloc(4)  # request 1 has a full first page as its prefix
    assert base is not None
    # Request 0: 0 -> 5 (2 pages); request 1: 4 -> 9 (2 pages); request 2: 3 -> 4 (no page).
    partial = alloc.alloc_extend([0], [3], [0])
    assert partial is not None
    before = alloc.available_size()
    out = alloc.alloc_extend([0, 4, 3], [5, 9, 4], [0, int(base[-1]), int(partial[-1])])
    assert out is not None and len(out) == 5 + 5 + 1
    assert before - alloc.available_size() == 4 * ps
    assert int(out[-1]) == int(partial[-1]) + 1


def test_alloc_extend_failure_takes_nothing() -> None:
    alloc = TokenToKVPoolAllocator(size=8, page_size=4)
    assert alloc.alloc_extend([0], [9], [0]) is None
    assert alloc.available_size() == 8


def test_alloc_decode_fills_page_before_taking_new_one() -> None:
    ps = 4
    alloc = TokenToKVPoolAllocator(size=16, page_size=ps)
    prefill = alloc.alloc_extend([0], [3], [0])
    assert prefill is not None
    used = alloc.available_size()
    slot = alloc.alloc_decode([4], [int(prefill[-1])])
    assert slot is not None and slot.tolist() == [int(prefill[-1]) + 1]
    assert alloc.available_size() == used
    nxt = alloc.alloc_decode([5], [int(slot[0])])
    assert nxt is not None and int(nxt[0]) % ps == 0
    assert alloc.available_size() == used - ps


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_after_scattered_frees_gets_ascending_slots(page_size: int) -> None:
    alloc = TokenToKVPoolAllocator(64, page_size)
    taken = alloc.alloc(64 - page_size)  # everything but the last page
    assert taken is not None
    pages = list(taken.split(page_size))
    order = torch.randperm(len(pages), generator=torch.Generator().manual_seed(3)).tolist()
    for i in order:  # freed in a scrambled order, a page at a time
        alloc.free(pages[i])
    # A decode step (one token per row) takes the list as it is: no per-step sort.
    one = alloc.alloc_extend([5], [6], [-1] if page_size == 1 else [int(taken[0])])
    assert one is not None and one.numel() == 1
    # A prefill sorts the free list first: its slots ascend.
    slots = alloc.alloc_extend([0, 0], [12, 8], [-1, -1])
    assert slots is not None and slots.numel() == 20
    assert torch.equal(slots, torch.sort(slots).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32])
def test_cpu_pool_buffers_are_zeros_of_the_asked_shape_and_dtype(dtype: torch.dtype) -> None:
    from engine.mem_cache.memory_pool import MHATokenToKVPool, zeroed_buffer

    buf = zeroed_buffer((5, 3, 4), dtype, "cpu")
    assert buf.shape == (5, 3, 4) and buf.dtype == dtype and buf.is_contiguous()
    assert not buf.float().any()
    buf[2, 1] = 1  # writable, and rows do not share memory
    assert buf.float().sum().item() == 4
    pool = MHATokenToKVPool(6, 1, torch.float32, 2, 8, 2, "cpu")
    assert [tuple(b.shape) for b in pool.k_buffer] == [(7, 2, 8)] * 2
    assert all(not b.any() for b in pool.k_buffer + pool.v_buffer)
    assert zeroed_buffer((0, 2), torch.float32, "cpu").shape == (0, 2)
