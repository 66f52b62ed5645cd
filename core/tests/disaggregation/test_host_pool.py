"""HostPool: payloads' K and V carved out of one host slab, reused once the backend lets them go."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.disaggregation.host_pool import ALIGN, HostPool


def _like(tokens: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty((2, tokens, 1, 64), dtype=dtype)  # 256 bytes a token in bfloat16


def test_a_payload_is_two_typed_tensors_of_its_own_over_the_slab() -> None:
    pool = HostPool(8 * ALIGN, pin=False)
    k_like, v_like = _like(16), _like(16, torch.float16)
    k, v = pool.take(k_like, v_like)
    assert (k.shape, k.dtype, v.shape, v.dtype) == (k_like.shape, torch.bfloat16, v_like.shape, torch.float16)
    k.fill_(1.5)
    v.fill_(-2.0)
    assert torch.all(k == 1.5) and torch.all(v == -2.0), "K and V overlap"
    base = pool._slab.data_ptr()
    assert k.data_ptr() == base and v.data_ptr() == base + ALIGN
    # A storage of its own, the region's size (the slab's would never be let go).
    assert k.untyped_storage().nbytes() == 2 * ALIGN and v.untyped_storage().data_ptr() == base
    assert pool.used_bytes() == 2 * ALIGN and pool.taken == 1 and pool.fresh == 0


def test_bytes_let_go_are_reused_lowest_offset_first() -> None:
    pool = HostPool(6 * ALIGN, pin=False)
    held = [pool.take(_like(16), _like(16)) for _ in range(3)]  # 2 * ALIGN each: the slab is full
    assert all(h is not None for h in held)
    assert pool.take(_like(16), _like(16)) is None
    middle_at = held[1][0].data_ptr()
    k, v = held[1]
    del held[1], k, v
    gc.collect()
    assert pool.used_bytes() == 4 * ALIGN
    again = pool.take(_like(16), _like(16))
    assert again is not None and again[0].data_ptr() == middle_at
    # A gap too small for a larger payload is passed over.
    assert pool.take(_like(32), _like(32)) is None


def test_a_payload_kept_by_one_tensor_keeps_its_region() -> None:
    pool = HostPool(2 * ALIGN, pin=False)
    k, v = pool.take(_like(16), _like(16))
    flat = v.reshape(-1)  # the backend's byte view of V (zmq frames), K already sent
    del k, v
    gc.collect()
    assert pool.take(_like(16), _like(16)) is None, "a region still read by the backend was handed out again"
    del flat
    gc.collect()
    assert pool.take(_like(16), _like(16)) is not None


def test_fresh_memory_for_what_never_fits_and_an_empty_v() -> None:
    pool = HostPool(2 * ALIGN, pin=False)
    assert not pool.fits(_like(64), _like(64))
    k, v = pool.take_fresh(_like(64), _like(64))
    assert k.shape == _like(64).shape and pool.fresh == 1
    mla_v = torch.empty((2, 16, 1, 0), dtype=torch.bfloat16)  # an MLA pool's V: K carries it
    k, v = pool.take(_like(16), mla_v)
    assert v.shape == mla_v.shape and v.numel() == 0 and pool.used_bytes() == ALIGN
    assert not HostPool(0, pin=False).fits(_like(1), _like(1))
    with pytest.raises(ValueError, match="host pool size: invalid value -1"):
        HostPool(-1, pin=False)
