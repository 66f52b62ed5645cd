"""``decode_fp8`` (stage 1 on Hopper's fp8 wgmma) on an H100/H200 against the float64 reference.

Llama-3-8B heads (32 query heads on 8 KV heads, head dim 128) and GQA 8 at head dim 64, e4m3
pools on shuffled pages filled with random data, rows of 1..1500 tokens, one split (the output
written directly) and several (merged), with and without programmatic dependent launch, every
mode (scores on the fp8 tensor cores; P times V: 1 float16 mma, 2 fp8 wgmma, 3 float16 wgmma),
q of magnitude 1 and 3e4 (scores kept O(1) by the softmax scale). Then a CUDA graph replayed on new rows and lengths.
Tolerances as for bf16 in test_triton_kernels.py.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a CUDA GPU with fp8 wgmma (sm_90+)"),
]
pytest.importorskip("triton", reason="the triton backend needs the triton package")

from engine_attention_triton.decode_attention import decode_attention_fwd  # noqa: E402
from engine_attention_triton.reference import reference_decode  # noqa: E402

BF16, FP8, DEV = torch.bfloat16, torch.float8_e4m3fn, "cuda"


def assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """bf16's limits in test_triton_kernels.py: max |err| <= 2e-2, ||err|| / ||ref|| <= 1e-2."""
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten or bad math)"
    err = (out.double() - ref.double()).abs()
    rel = (err.norm() / ref.double().norm()).item()
    assert err.max().item() <= 2e-2 and rel <= 1e-2, f"{what}: max abs err {err.max().item():.3g}, rel L2 {rel:.3g}"


class Pool:
    """Rows of up to ``max_len`` tokens on shuffled slots of a random e4m3 pool; the rest of
    ``req_to_token`` random too (a stray read changes the result)."""

    def __init__(self, capacity: list[int], kv_heads: int, head_dim: int) -> None:
        slots = sum(capacity) + 7
        self.k = torch.randn(slots, kv_heads, head_dim, device=DEV).to(FP8)
        self.v = torch.randn(slots, kv_heads, head_dim, device=DEV).to(FP8)
        self.req_to_token = torch.randint(0, slots, (len(capacity) + 3, max(capacity) + 70), dtype=torch.int32,
                                          device=DEV)
        order = torch.randperm(slots, device=DEV).to(torch.int32)
        self.rows = torch.randperm(len(capacity) + 3)[: len(capacity)].tolist()
        used = 0
        for row, n in zip(self.rows, capacity, strict=True):
            self.req_to_token[row, :n] = order[used : used + n]
            used += n


def random_lens(n: int, low: int, high: int) -> list[int]:
    lens = [random.randint(low, high) for _ in range(n)]
    lens[0], lens[-1] = high, low
    return lens


@pytest.mark.parametrize("mode", [1, 2, 3])
@pytest.mark.parametrize("group,kv_heads,head_dim,bs,splits,pdl,q_scale", [
    (4, 8, 128, 37, 1, True, 1.0), (4, 8, 128, 37, 3, False, 1.0), (4, 8, 128, 5, 16, True, 3e4),
    (8, 2, 64, 19, 2, True, 1.0),
])
def test_fp8_mma_matches_reference(seed: int, mode: int, group: int, kv_heads: int, head_dim: int, bs: int,
                                   splits: int, pdl: bool, q_scale: float) -> None:
    seq_lens = random_lens(bs, 1, 1500)
    pool = Pool(seq_lens, kv_heads, head_dim)
    k, v = pool.k, pool.v
    q = torch.randn(bs, group * kv_heads, head_dim, dtype=BF16, device=DEV) * q_scale
    scale = 1.0 / q_scale / head_dim**0.5
    out = torch.full_like(q, float("nan"))
    part_out = torch.full((bs, q.shape[1], splits, head_dim), float("nan"), device=DEV)
    part_lse = torch.full((bs, q.shape[1], splits), float("nan"), device=DEV)
    decode_attention_fwd(q, k, v, out, pool.req_to_token, torch.tensor(pool.rows, device=DEV),
                         torch.tensor(seq_lens, device=DEV), part_out, part_lse, splits, scale, k_scale=0.5, v_scale=2.0,
                         fp8_mma=mode, pdl=pdl)
    ref = reference_decode(q, k.double() * 0.5, v.double() * 2.0, pool.req_to_token, pool.rows, seq_lens, scale)
    assert_matches(out, ref, f"fp8_mma={mode} splits={splits} pdl={pdl} q_scale={q_scale} seed={seed}")


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_fp8_mma_in_a_cuda_graph_replays_new_lengths(seed: int, mode: int) -> None:
    bs, heads, kv_heads, head_dim = 64, 32, 8, 128
    capacity = random_lens(96, 1, 1200)
    pool = Pool(capacity, kv_heads, head_dim)
    k, v = pool.k, pool.v
    q = torch.empty(bs, heads, head_dim, dtype=BF16, device=DEV)
    out = torch.empty_like(q)
    reqs = torch.zeros(bs, dtype=torch.int64, device=DEV)
    lens = torch.ones(bs, dtype=torch.int64, device=DEV)
    part_out = torch.empty(bs, heads, 2, head_dim, device=DEV)
    part_lse = torch.empty(bs, heads, 2, device=DEV)

    def call() -> None:
        decode_attention_fwd(q, k, v, out, pool.req_to_token, reqs, lens, part_out, part_lse, 2,
                             head_dim**-0.5, fp8_mma=mode, pdl=True)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for replay in range(3):
        rows = random.sample(range(len(capacity)), bs)
        row_lens = [random.randint(1, capacity[r]) for r in rows]
        slots = [pool.rows[r] for r in rows]
        reqs.copy_(torch.tensor(slots, device=DEV))
        lens.copy_(torch.tensor(row_lens, device=DEV))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_decode(q, k.double(), v.double(), pool.req_to_token, slots, row_lens, head_dim**-0.5)
        assert_matches(out, ref, f"fp8_mma={mode} replay {replay} seed={seed}")
