"""The SGMV kernels against the torch loop, on the CPU under Triton's interpreter.

The root conftest sets ``TRITON_INTERPRET=1`` where no CUDA device is present; the backend then
lists the cpu device too and the same kernels run in numpy. Tiny shapes (the interpreter runs
every program in Python): both kernel forms (token tiles with ``tl.dot``, and one token per
program for decode), empty segments, rank-0 slots holding stale weights, one to three slices at
uneven column offsets, strided tensors, decode batches large enough for the per-slot expand, and a
``max_seg_len`` above the longest segment with padding tokens after the last segment (as a
captured CUDA-graph batch has).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from engine_lora_triton import interpreting
from engine_lora_triton.backend import TritonLoraBackend
from engine_lora_triton.launch import sgmv_expand, sgmv_shrink, sgmv_shrink_slots

from engine.lora.backend import LoraBatchInfo, reference_expand, reference_shrink
from engine.testing.conformance.lora import LoraBackendConformance, random_pool_weights

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (set where no GPU is present)")


class TestTritonLoraInterpreted(LoraBackendConformance):
    backend_name = "triton"
    device = "cpu"


def _pool(ranks: list[int], n_slices: int, r: int, k: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A and B with zeros beyond each slot's rank; rank-0 slots keep stale values (drawn from the
    global generator, which the tests seed)."""
    return random_pool_weights(torch.default_generator, n_slices, k, n, torch.device("cpu"), dtype, tuple(ranks), r)


# (segment lengths, slots, slot ranks, R, K, slice offsets, padding tokens, max_seg_len slack)
CASES = {
    "decode-qkv": ([1, 1, 1, 1, 1, 1], [2, 0, 2, 1, 3, 1], [0, 4, 16, 8], 16, 40, [0, 16, 24, 32], 0, 0),
    "decode-padded": ([1, 1, 0, 1], [1, 0, 1, 1], [0, 8], 8, 24, [0, 24], 3, 0),
    # 16+ segments: expand runs one program per (slot, column tile) over the batch's tokens.
    "decode-slots": ([1] * 9 + [0] + [1] * 8, [i * 5 % 4 for i in range(18)], [0, 4, 8, 8], 8, 16, [0, 70, 80], 2, 0),
    "prefill-gate-up": ([5, 0, 19, 1, 0, 3], [1, 2, 0, 1, 1, 2], [0, 8, 4], 8, 48, [5, 21, 37], 2, 4),
    "prefill-o": ([0, 17, 6], [0, 1, 0], [16, 0], 16, 64, [0, 40], 0, 0),
    # More segments than one pass of the per-slot expand (64 a pass).
    "decode-slots-many": ([1] * 70, [i * 7 % 3 for i in range(70)], [8, 0, 4], 8, 24, [0, 20], 0, 0),
    # More pool slots than the dense expand unrolls (32): it loops over them.
    "decode-40-slots": ([1] * 20, [i * 7 % 40 for i in range(20)], [8 * (i % 3 > 0) for i in range(40)], 8, 16,
                        [0, 24], 0, 0),
    "decode-slots-qkv": ([1] * 11 + [0] + [1] * 8, [i * 3 % 5 for i in range(20)], [16, 0, 8, 16, 4], 16, 24,
                         [3, 43, 59, 75], 1, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_match_the_loop(case: str, batch_info: Callable[..., LoraBatchInfo]) -> None:
    torch.manual_seed(sorted(CASES).index(case))
    lens, slots, ranks, r, k, offsets, pad, slack = CASES[case]
    info = batch_info(lens, slots, ranks, max_seg_len=max(lens) + slack)
    backend = TritonLoraBackend()
    n_slices = len(offsets) - 1
    real = sum(lens)
    tokens = real + pad
    a, b = _pool(ranks, n_slices, r, k, offsets[-1] + 3, torch.float32)
    # x and out are column windows of wider tensors: the kernels must follow the strides.
    x = torch.randn(tokens, k + 5)[:, 2:k + 2]
    y = backend.shrink(x, a, info)
    want_y = reference_shrink(x, a, info)
    torch.testing.assert_close(y[:real], want_y[:real], atol=1e-5, rtol=1e-5)
    wide = torch.randn(tokens, offsets[-1] + 7)
    out = wide[:, 1:offsets[-1] + 4]
    before = out.clone()
    backend.expand(want_y, b, info, out, offsets)
    want = before.clone()
    reference_expand(want_y, b, info, want, offsets)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    if info.max_seg_len <= 1 and info.num_segments >= 16:  # the dense expand (lora-triton.dense_expand)
        dense = before.clone()
        TritonLoraBackend(dense_expand=True).expand(want_y, b, info, dense, offsets)
        torch.testing.assert_close(dense, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(dense[real:], before[real:])
    # Columns outside the slices, padding tokens and rank-0 segments keep their exact bits.
    assert torch.equal(out[:, :offsets[0]], before[:, :offsets[0]])
    assert torch.equal(out[:, offsets[-1]:], before[:, offsets[-1]:])
    assert torch.equal(out[real:], before[real:])


@pytest.mark.parametrize("case", ["decode-slots", "decode-slots-many", "decode-slots-qkv", "decode-qkv",
                                  "prefill-gate-up", "prefill-o"])
@pytest.mark.parametrize("chunk", [0, 32])
def test_apply_matches_the_loop(case: str, chunk: int, batch_info: Callable[..., LoraBatchInfo]) -> None:
    """``apply``: decode batches of 16+ segments take the per-slot shrink's float32 partial sums
    over K chunks, others shrink + expand; ``chunk`` 32: three chunks of K 80, the last one short,
    through the per-slot shrink or the split token-tile shrink (a short prefill's)."""
    torch.manual_seed(len(case) + chunk)
    lens, slots, ranks, r, _, offsets, pad, slack = CASES[case]
    k = 80
    info = batch_info(lens, slots, ranks, max_seg_len=max(lens) + slack)
    n_slices = len(offsets) - 1
    real = sum(lens)
    a, b = _pool(ranks, n_slices, r, k, offsets[-1] + 3, torch.float32)
    x = torch.randn(real + pad, k + 5)[:, 2:k + 2]
    out = torch.randn(real + pad, offsets[-1] + 3)
    want = out.clone()
    reference_expand(reference_shrink(x, a, info), b, info, want, offsets)
    if chunk:
        if info.max_seg_len > 1:
            cfg = dict(BLOCK_T=16, BLOCK_R=16, BLOCK_K=16, K_CHUNK=chunk, num_warps=4, num_stages=1)
            p = sgmv_shrink(x, a, info.seg_indptr, info.weight_indices, info.lora_ranks, info.num_segments,
                            info.max_seg_len, config=cfg, split=True)
        elif info.num_segments >= 16:
            cfg = dict(BLOCK_R=16, BLOCK_K=16, K_CHUNK=chunk, num_warps=4, num_stages=1)
            p = sgmv_shrink_slots(x, a, info.seg_indptr, info.weight_indices, info.lora_ranks, info.num_segments,
                                  config=cfg)
        else:
            pytest.skip("decode batches of fewer than 16 segments have no partial sums")
        assert p.shape == (3, real + pad, n_slices * r) and p.dtype == torch.float32
        dense = out.clone()
        sgmv_expand(p, b, dense, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                    info.num_segments, info.max_seg_len, offsets, dense=True)
        torch.testing.assert_close(dense, want, atol=1e-5, rtol=1e-5)
        sgmv_expand(p, b, out, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                    info.num_segments, info.max_seg_len, offsets)
    else:
        # The default forms, then the per-slot shrink with the dense expand (both options on).
        plain = out.clone()
        TritonLoraBackend().apply(x, a, b, info, plain, offsets)
        torch.testing.assert_close(plain, want, atol=1e-5, rtol=1e-5)
        TritonLoraBackend(slot_shrink=True, dense_expand=True).apply(x, a, b, info, out, offsets)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[real:], want[real:])


@pytest.mark.parametrize("case", ["decode-slots", "decode-slots-qkv"])
@pytest.mark.parametrize("partials", [False, True])
def test_slot_expand_tile_groups(case: str, partials: bool, batch_info: Callable[..., LoraBatchInfo]) -> None:
    """The per-slot expand with programs over groups of 4 column tiles of 16: groups end at slice
    ends (a last group with tiles past its slice), from y or from two chunks of partial sums."""
    torch.manual_seed(11 + partials)
    lens, slots, ranks, r, k, offsets, pad, slack = CASES[case]
    info = batch_info(lens, slots, ranks, max_seg_len=max(lens) + slack)
    n_slices = len(offsets) - 1
    real = sum(lens)
    a, b = _pool(ranks, n_slices, r, k, offsets[-1] + 3, torch.float32)
    x = torch.randn(real + pad, k)
    y = reference_shrink(x, a, info)
    if partials:
        half = torch.rand_like(y)
        y = torch.stack([y * half, y * (1 - half)])
    out = torch.randn(real + pad, offsets[-1] + 3)
    want = out.clone()
    reference_expand(reference_shrink(x, a, info), b, info, want, offsets)
    cfg = dict(SLOTS=1, BLOCK_T=1, BLOCK_N=16, BLOCK_R=16, TILES=4, num_warps=4, num_stages=1)
    sgmv_expand(y, b, out, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings, info.num_segments,
                info.max_seg_len, offsets, config=cfg)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, :offsets[0]], want[:, :offsets[0]])
    assert torch.equal(out[:, offsets[-1]:], want[:, offsets[-1]:])


def test_bfloat16_decode_and_prefill(batch_info: Callable[..., LoraBatchInfo]) -> None:
    torch.manual_seed(7)
    ranks = [16, 0, 8]
    a, b = _pool(ranks, 3, 16, 32, 48, torch.bfloat16)
    backend = TritonLoraBackend()
    for lens, slots in (([1, 1, 1, 1], [0, 1, 2, 0]), ([9, 0, 7], [2, 1, 0])):
        info = batch_info(lens, slots, ranks)
        x = torch.randn(sum(lens), 32).to(torch.bfloat16)
        y = backend.shrink(x, a, info)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, reference_shrink(x, a, info), atol=2e-2, rtol=2e-2)
        out = torch.randn(sum(lens), 48).to(torch.bfloat16)
        want = out.clone()
        reference_expand(y, b, info, want, [0, 32, 40, 48])
        backend.expand(y, b, info, out, [0, 32, 40, 48])
        torch.testing.assert_close(out, want, atol=5e-2, rtol=2e-2)


def test_bad_shapes_are_named(batch_info: Callable[..., LoraBatchInfo]) -> None:
    info = batch_info([2], [0], [4])
    backend = TritonLoraBackend()
    y = torch.zeros(2, 8)
    out = torch.zeros(2, 16)
    b = torch.zeros(1, 16, 4)
    with pytest.raises(ValueError, match=r"slice_offsets \[0, 4, 8, 12, 14, 16\] gives 5 slices; 1 to 3"):
        backend.expand(y, b, info, out, [0, 4, 8, 12, 14, 16])
    with pytest.raises(ValueError, match=r"slice_offsets \[0, 20\] must rise within out's 16 columns"):
        backend.expand(y, b, info, out, [0, 20])
    with pytest.raises(ValueError, match=r"y \(2, 8\) must be \[T, n_slices \* R\] = \[2, 4\]"):
        backend.expand(y, b, info, out, [0, 16])
    with pytest.raises(ValueError, match=r"shrink: x \(2, 6\) must be \[T, K\] and weights \(1, 8, 5\)"):
        backend.shrink(torch.zeros(2, 6), torch.zeros(1, 8, 5), info)
    with pytest.raises(ValueError, match=r"shrink: weights dtype torch.bfloat16 must be x's dtype torch.float32"):
        backend.shrink(torch.zeros(2, 6), torch.zeros(1, 8, 6, dtype=torch.bfloat16), info)
