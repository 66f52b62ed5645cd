"""``decode_fp8_mma`` (e4m3 pool, bf16 queries, one split, operands built in registers) against the
float64 reference, on ragged rows of shuffled pages, everything else in the pool random, outputs
poisoned with NaN first: GQA groups 1 to 8, head dims 64 and 128, a sliding window, K/V scales,
PDL launches, CUDA-graph replays over new rows and lengths, queries beyond float16's range, every
e4m3 value, each value column's place, and ``decode_attention_fwd``'s choice of it at one split.
Tolerances as test_triton_kernels.py's for bf16.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU with the e4m3 conversion (sm_89+)"),
]
pytest.importorskip("triton", reason="the triton backend needs the triton package")
pytest.importorskip("triton.experimental.gluon", reason="decode_fp8_mma is a Gluon kernel")

from engine_attention_triton.decode_attention import decode_attention_fwd, decode_tiles, has_pdl  # noqa: E402
from engine_attention_triton.decode_fp8_mma import decode_fp8_mma_fwd, fits  # noqa: E402
from engine_attention_triton.reference import reference_decode  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import test_triton_kernels  # noqa: E402
from test_triton_kernels import one_e4m3_key_per_row, random_lens  # noqa: E402

BF16, FP8, DEV = torch.bfloat16, torch.float8_e4m3fn, "cuda"


def assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """bf16's tolerances of test_triton_kernels.py: max |err| <= 2e-2, ||err|| / ||ref|| <= 1e-2."""
    test_triton_kernels.assert_matches(out, ref, BF16, what)


class Pools:
    """An e4m3 pool (random everywhere) with rows of the given lengths on shuffled pages of ``page_size``
    slots, and a ``req_to_token`` whose unused entries are random slots, rows not in batch order."""

    def __init__(self, seq_lens: list[int], page_size: int, kv_heads: int, head_dim: int) -> None:
        pages_per_row = [-(-n // page_size) for n in seq_lens]
        num_pages = sum(pages_per_row) + 7
        slots = (num_pages + 1) * page_size
        self.k = torch.randn(slots, kv_heads, head_dim, device=DEV).to(FP8)
        self.v = torch.randn(slots, kv_heads, head_dim, device=DEV).to(FP8)
        self.req_to_token = torch.randint(0, slots, (len(seq_lens) + 5, max(seq_lens) + 33), dtype=torch.int32,
                                          device=DEV)
        pages = (torch.randperm(num_pages, device=DEV) + 1).tolist()
        self.req_slots = torch.randperm(len(seq_lens) + 5)[: len(seq_lens)].tolist()
        offsets = torch.arange(page_size, device=DEV)
        for req, n, count in zip(self.req_slots, seq_lens, pages_per_row, strict=True):
            row_pages = torch.tensor([pages.pop() for _ in range(count)], device=DEV)
            self.req_to_token[req, :n] = (row_pages[:, None] * page_size + offsets).reshape(-1)[:n].to(torch.int32)
        self.seq_lens = torch.tensor(seq_lens, device=DEV)
        self.lens = seq_lens

    def indices(self) -> torch.Tensor:
        return torch.tensor(self.req_slots, dtype=torch.int64, device=DEV)

    def reference(self, q: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                  window: int = -1) -> torch.Tensor:
        return reference_decode(q, self.k.float() * k_scale, self.v.float() * v_scale, self.req_to_token,
                                self.req_slots, self.lens, scale, sliding_window_size=window)

# id, group, kv heads, head_dim, page size, batch, max len, window
CASES = [
    ("g4-d128-ps1", 4, 8, 128, 1, 37, 1500, -1),
    ("g4-d128-ps16", 4, 2, 128, 16, 23, 700, -1),
    ("g8-d128", 8, 2, 128, 1, 9, 300, -1),
    ("g1-d128", 1, 4, 128, 16, 7, 200, -1),
    ("g7-d64", 7, 2, 64, 1, 11, 900, -1),
    ("g4-d64-ps16", 4, 4, 64, 16, 6, 100, -1),
    ("g4-d128-window", 4, 2, 128, 1, 13, 600, 40),
    ("g2-d128-window0", 2, 2, 128, 16, 5, 300, 0),
]


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("group,kv_heads,head_dim,page_size,bs,max_len,window", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_matches_reference(seed: int, group: int, kv_heads: int, head_dim: int, page_size: int, bs: int,
                           max_len: int, window: int, pdl: bool) -> None:
    if pdl and not has_pdl(torch.device(DEV)):
        pytest.skip("programmatic dependent launch needs sm_90+")
    pools = Pools(random_lens(bs, 1, max_len), page_size, kv_heads, head_dim)
    q = torch.randn(bs, group * kv_heads, head_dim, dtype=BF16, device=DEV)
    out = torch.full_like(q, float("nan"))
    assert fits(q, pools.k, pools.v)
    scale = head_dim**-0.5
    decode_fp8_mma_fwd(q, pools.k, pools.v, out, pools.req_to_token, pools.indices(), pools.seq_lens, scale, window,
                       k_scale=0.5, v_scale=2.0, pdl=pdl)
    assert_matches(out, pools.reference(q, scale, 0.5, 2.0, window),
                   f"group={group} kv_heads={kv_heads} head_dim={head_dim} window={window} pdl={pdl} seed={seed}")


@pytest.mark.parametrize("q_scale", [1.0, 3e4, 1e6], ids=["q1", "q3e4", "q1e6"])
def test_queries_beyond_the_float16_range(seed: int, q_scale: float) -> None:
    """q is multiplied in float16: a row whose q exceeds float16's range (65504) is scaled by 2^-16
    and its scores by 2^16."""
    pools = Pools(random_lens(5, 1, 400), 1, 2, 128)
    q = torch.randn(5, 8, 128, dtype=BF16, device=DEV) * q_scale
    scale = 0.3 / q_scale / 128**0.5
    out = torch.full_like(q, float("nan"))
    decode_fp8_mma_fwd(q, pools.k, pools.v, out, pools.req_to_token, pools.indices(), pools.seq_lens, scale)
    assert_matches(out, pools.reference(q, scale), f"q_scale={q_scale} seed={seed}")


def test_every_e4m3_value_widens_exactly() -> None:
    """Row i attends to one key whose K and V hold e4m3 bit pattern i (all 254 but NaN) in every
    dim: with one key the output is that value, which bf16 holds exactly (subnormals included)."""
    bits, values, k, v, req_to_token, q = one_e4m3_key_per_row(4)
    n = values.numel()
    out = torch.full_like(q, float("nan"))
    decode_fp8_mma_fwd(q, k, v, out, req_to_token, torch.arange(n, device=DEV),
                       torch.ones(n, dtype=torch.int64, device=DEV), 1.0)
    want = values.to(BF16)[:, None, None].expand(n, 4, 128)
    bad = (out.float() != want.float()).flatten(1).any(1)  # value compare: -0 may come out +0
    assert not bad.any(), f"wrong for e4m3 bits {bits[bad].tolist()}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_value_columns_land_in_place(head_dim: int) -> None:
    """Output column c of each head is value column c (the store undoes the operand's column order):
    two keys whose V holds c % 16 on one KV head and c // 16 on the other (exact in e4m3)."""
    cols = torch.arange(head_dim, device=DEV).float()
    v = torch.zeros(3, 2, head_dim, device=DEV)
    v[:, 0] = cols % 16
    v[:, 1] = torch.div(cols, 16, rounding_mode="floor")
    k = torch.zeros(3, 2, head_dim, dtype=FP8, device=DEV)
    req_to_token = torch.tensor([[1, 2, 0, 0]], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 8, head_dim, dtype=BF16, device=DEV)
    out = torch.full_like(q, float("nan"))
    decode_fp8_mma_fwd(q, k, v.to(FP8), out, req_to_token, torch.zeros(1, dtype=torch.int64, device=DEV),
                       torch.full((1,), 2, dtype=torch.int64, device=DEV), 1.0)
    want = torch.cat([v[0, :1].expand(4, head_dim), v[0, 1:].expand(4, head_dim)])
    assert torch.equal(out[0].float(), want), f"head_dim={head_dim}: columns out of place"


@pytest.mark.parametrize("bs,block_n", [(900, 16), (100, 32)])
def test_decode_attention_fwd_takes_it_at_one_split(seed: int, bs: int, block_n: int) -> None:
    """``decode_attention_fwd`` with its own tiles at one split over 8 KV heads (a decode graph's batch)
    runs this kernel (``decode_tiles(...).mma_block_n``: 16-key blocks at 900 rows, 32-key ones at 100)
    and matches the reference."""
    from unittest import mock

    from engine_attention_triton import decode_fp8_mma

    assert decode_tiles(BF16, 128, 1, True, bs * 8).mma_block_n == block_n
    pools = Pools(random_lens(bs, 1, 300), 1, 8, 128)
    q = torch.randn(bs, 32, 128, dtype=BF16, device=DEV)
    out = torch.full_like(q, float("nan"))
    part = torch.full((bs, 32, 1, 128), float("nan"), device=DEV)
    with mock.patch.object(decode_fp8_mma, "decode_fp8_mma_fwd", wraps=decode_fp8_mma_fwd) as mma_fwd:
        decode_attention_fwd(q, pools.k, pools.v, out, pools.req_to_token, pools.indices(), pools.seq_lens, part,
                             part[..., 0], 1, 128**-0.5, k_scale=0.5, v_scale=2.0, pdl=has_pdl(q.device))
    assert mma_fwd.call_count == 1 and mma_fwd.call_args.kwargs["block_n"] == block_n, mma_fwd.call_args
    assert_matches(out, pools.reference(q, 128**-0.5, 0.5, 2.0), f"{bs} rows, default tiles, seed={seed}")


def test_shapes_it_does_not_take_are_a_clear_error() -> None:
    q = torch.randn(2, 8, 96, dtype=BF16, device=DEV)
    k = torch.zeros(4, 2, 96, dtype=FP8, device=DEV)
    assert not fits(q, k, k)
    with pytest.raises(ValueError, match="head dims 64 or 128"):
        decode_fp8_mma_fwd(q, k, k, q.clone(), torch.zeros(2, 4, dtype=torch.int32, device=DEV),
                           torch.arange(2, device=DEV), torch.ones(2, dtype=torch.int64, device=DEV), 1.0)
    k128 = torch.zeros(4, 2, 128, dtype=FP8, device=DEV)
    assert not fits(q.new_zeros(2, 18, 128), k128, k128)  # 9 query heads a KV head
    assert not fits(q.new_zeros(2, 8, 128).half(), k128, k128)


def test_cuda_graph_replays_new_rows_and_lengths(seed: int) -> None:
    """Captured once in a CUDA graph (with PDL where the GPU has it), replayed over other rows, lengths
    and queries: the lengths are read on the device, so each replay matches the reference."""
    bs = 8
    capacity = random_lens(16, 1, 2500)
    pools = Pools(capacity, 16, 8, 128)
    q = torch.randn(bs, 32, 128, dtype=BF16, device=DEV)
    out = torch.full_like(q, float("nan"))
    reqs = torch.zeros(bs, dtype=torch.int64, device=DEV)
    lens = torch.ones(bs, dtype=torch.int64, device=DEV)
    pdl = has_pdl(q.device)

    def call() -> None:
        decode_fp8_mma_fwd(q, pools.k, pools.v, out, pools.req_to_token, reqs, lens, 128**-0.5, pdl=pdl)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for replay in range(3):
        rows = random.sample(range(16), bs)
        row_lens = [random.randint(1, capacity[r]) for r in rows]
        reqs.copy_(torch.tensor([pools.req_slots[r] for r in rows]))
        lens.copy_(torch.tensor(row_lens))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_decode(q, pools.k.float(), pools.v.float(), pools.req_to_token,
                               [pools.req_slots[r] for r in rows], row_lens, 128**-0.5)
        assert_matches(out, ref, f"graph replay {replay} seed={seed}")


def test_a_row_of_length_zero_writes_zeros(seed: int) -> None:
    """A row of length 0 (as a padded CUDA-graph row may be) writes zeros; the others are unaffected."""
    pools = Pools([5, 300, 17], 1, 2, 128)
    pools.seq_lens[0] = 0
    q = torch.randn(3, 8, 128, dtype=BF16, device=DEV)
    out = torch.full_like(q, float("nan"))
    decode_fp8_mma_fwd(q, pools.k, pools.v, out, pools.req_to_token, pools.indices(), pools.seq_lens, 128**-0.5)
    assert torch.equal(out[0], torch.zeros_like(out[0])), f"seed={seed}"
    pools.lens = [300, 17]
    pools.req_slots = pools.req_slots[1:]
    assert_matches(out[1:], pools.reference(q[1:], 128**-0.5), f"seed={seed}")
