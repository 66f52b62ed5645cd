"""The extend path's launch order and the fp8 pool's read-back of new tokens, under Triton's
interpreter.

- ``_extend_kernel`` with the last query blocks launched first (``HEAVY_BLOCKS_FIRST``) and in the
  plain order, on rows of different lengths with and without a cached prefix (a short row's
  blocks past its end must write nothing), against the float64 reference; outputs poisoned with
  NaN first. float32 only: Triton's interpreter computes 16-bit ``tl.dot`` wrongly.
- ``gather_widened`` against ``k_buffer[loc].to(dtype)`` bit for bit on the finite codes, on e4m3
  and e5m2 pools filled with every code, slots in random order and repeated.
"""

from __future__ import annotations

import pytest
import torch
from engine_attention_triton import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (set where no GPU is present)")

import engine_attention_triton.extend_attention as extend_module  # noqa: E402
from engine_attention_triton.extend_attention import extend_attention_fwd, gather_widened  # noqa: E402
from engine_attention_triton.interpreter_compat import patch_interpreter_index  # noqa: E402
from engine_attention_triton.reference import reference_extend  # noqa: E402

SCALE = 0.15


@pytest.mark.parametrize("heavy_first", [True, False], ids=["heavy-first", "plain-order"])
def test_extend_launch_orders_match_the_reference(heavy_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    patch_interpreter_index()
    monkeypatch.setattr(extend_module, "HEAVY_BLOCKS_FIRST", heavy_first)
    gen = torch.Generator().manual_seed(7)
    group, kv_heads, head_dim = 2, 2, 32
    prefix_lens, extend_lens = [0, 21, 0], [70, 9, 33]
    slots = sum(prefix_lens) + 5
    k_buf = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_buf = torch.randn(slots, kv_heads, head_dim, generator=gen)
    req_to_token = torch.randint(0, slots, (4, 40), generator=gen, dtype=torch.int32)
    req_to_token[2, :21] = torch.randperm(slots, generator=gen)[:21].to(torch.int32)
    rows = [1, 2, 0]
    tokens = sum(extend_lens)
    q = torch.randn(tokens, group * kv_heads, head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    starts = torch.tensor([0, 70, 79])
    extend_attention_fwd(q, k, v, out, k_buf, v_buf, req_to_token, torch.tensor(rows), torch.tensor(prefix_lens),
                         torch.tensor(extend_lens), starts, max(extend_lens), SCALE, config=(16, 16, 4, 1))
    ref = reference_extend(q, k, v, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, SCALE)
    assert not torch.isnan(out).any(), "an output row was not written"
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-4, f"max abs error {err:.3g} against the float64 reference"


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_widened_equals_the_torch_ops(fp8: torch.dtype, dtype: torch.dtype) -> None:
    patch_interpreter_index()
    gen = torch.Generator().manual_seed(3)
    slots, kv_heads, head_dim, v_dim = 40, 2, 64, 32
    # Every byte value (NaN codes included) somewhere in the pool.
    codes = torch.arange(slots * kv_heads * head_dim, dtype=torch.int64) % 256
    k_buf = codes[torch.randperm(codes.numel(), generator=gen)].to(torch.uint8).view(fp8)
    k_buf = k_buf.view(slots, kv_heads, head_dim)
    v_buf = torch.randint(0, 256, (slots, kv_heads, v_dim), generator=gen, dtype=torch.uint8).view(fp8)
    loc = torch.cat([torch.randperm(slots, generator=gen)[:25], torch.tensor([3, 3, 0])])
    k_new, v_new = gather_widened(k_buf, v_buf, loc, dtype)
    for got, want in ((k_new, k_buf[loc].to(dtype)), (v_new, v_buf[loc].to(dtype))):
        assert got.shape == want.shape and got.dtype == dtype
        # Bit for bit (signed zeros included) on the finite codes. The interpreter's fp8 emulation
        # widens the NaN/inf codes as if finite (e4m3 0x7f gives 480); a GPU converts in hardware.
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        same = (got.view(bits) == want.view(bits)) | ~want.isfinite()
        assert same.all(), f"{int((~same).sum())} values differ from the torch widening"
    empty_k, empty_v = gather_widened(k_buf, v_buf, loc[:0], dtype)
    assert empty_k.shape == (0, kv_heads, head_dim) and empty_v.shape == (0, kv_heads, v_dim)


def test_gather_widened_strided_pool_rows_take_the_torch_ops(caplog: pytest.LogCaptureFixture) -> None:
    """A pool whose rows do not hold their KV heads back to back (a view with heads and slots
    swapped) is read back by the torch ops, with a warning, and gives the same values."""
    patch_interpreter_index()
    gen = torch.Generator().manual_seed(5)
    pool = torch.randint(0, 120, (2, 12, 16), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    k_buf = v_buf = pool.transpose(0, 1)  # [slots 12, heads 2, dim 16], each row's heads 12 * 16 apart
    loc = torch.tensor([4, 0, 4, 11])
    extend_module._warn_strided_pool_rows.cache_clear()
    with caplog.at_level("WARNING", logger=extend_module.__name__):
        k_new, v_new = gather_widened(k_buf, v_buf, loc, torch.float32)
    assert "gather_widened" in caplog.text
    assert torch.equal(k_new, k_buf[loc].float()) and torch.equal(v_new, v_buf[loc].float())
