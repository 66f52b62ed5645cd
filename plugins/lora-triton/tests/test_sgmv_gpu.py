"""The SGMV kernels on a CUDA GPU at Llama-3-8B's shapes (K 4096, N 4096/1024 per slice, ranks 16
and 64, bfloat16; decode over 9 slots, prefills of 529 and 128 tokens), compiled (not
interpreted), against the float32 torch loop; the conformance kit
on cuda; and CUDA graphs (one-token segments, and 16-token ones) replayed after the batch's
segments change in place, as the engine's captured decode rewrites ``seg_indptr`` and
``weight_indices`` between replays; ``apply`` on decode batches of 64 (the per-slot shrink's
partial sums, K 4096 and 14336, in a graph too) and prefills (a 128-token one split over K)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from engine_lora_triton.backend import TritonLoraBackend

from engine.lora.backend import LoraBatchInfo, reference_expand, reference_shrink
from engine.testing.conformance.lora import LoraBackendConformance, random_pool_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
SLOTS = 9


class TestTritonLoraCuda(LoraBackendConformance):
    backend_name = "triton"
    device = "cuda"


def _pool(ranks: list[int], r: int, k: int, widths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    return random_pool_weights(torch.default_generator, len(widths), k, sum(widths), torch.device(DEV),
                               torch.bfloat16, tuple(ranks), r)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("r", [16, 64])
@pytest.mark.parametrize("widths", [(4096, 1024, 1024), (4096,), (1024, 1024)], ids=["qkv", "o", "kv"])
@pytest.mark.parametrize("lens", [[1] * 64, [300, 0, 1, 211, 17], [128]], ids=["decode", "prefill", "short-prefill"])
def test_llama_shapes(r: int, widths: tuple[int, ...], lens: list[int], batch_info: Callable[..., LoraBatchInfo]) -> None:
    torch.manual_seed(r + len(widths) + len(lens))
    ranks = [r, r // 2, 0] + [r] * (SLOTS - 3)
    slots = [i % SLOTS for i in range(len(lens))]
    info = batch_info(lens, slots, ranks, DEV)
    a, b = _pool(ranks, r, 4096, widths)
    x = torch.randn(sum(lens), 4096, device=DEV).bfloat16()
    backend = TritonLoraBackend()
    y = backend.shrink(x, a, info)
    assert _rel(y, reference_shrink(x, a, info)) < 1e-2
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    out = torch.randn(sum(lens), offsets[-1], device=DEV).bfloat16()
    want = out.float()
    reference_expand(y, b, info, want, offsets)
    backend.expand(y, b, info, out, offsets)
    assert _rel(out, want) < 1e-2


@pytest.mark.parametrize("r", [16, 64])
@pytest.mark.parametrize("layer", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("lens", [[1] * 64, [128], [5, 0, 300, 60], [1] * 63 + [0]],
                         ids=["decode", "short-prefill", "prefill", "decode-per-slot-expand"])
def test_apply_llama_shapes(r: int, layer: str, lens: list[int], batch_info: Callable[..., LoraBatchInfo]) -> None:
    """``apply`` against the float32 loop: a decode batch of 64 over 9 slots (the per-slot shrink's
    partial sums over K chunks, added up by the dense expand, or by the per-slot expand), a
    128-token prefill (the token-tile shrink split over K chunks) and a prefill of several segments
    (whole-K programs)."""
    k, widths = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)),
                 "down": (14336, (4096,))}[layer]
    torch.manual_seed(r + k + len(lens))
    ranks = [r, r // 2, 0] + [r] * (SLOTS - 3)
    info = batch_info(lens, [i * 5 % SLOTS for i in range(len(lens))], ranks, DEV)
    a, b = _pool(ranks, r, k, widths)
    tokens = sum(lens)
    x = torch.randn(tokens, k, device=DEV).bfloat16()
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    out = torch.randn(tokens, offsets[-1], device=DEV).bfloat16()
    want = out.float()
    reference_expand(reference_shrink(x.float(), a.float(), info), b.float(), info, want, offsets)
    before = out.clone()
    # Decode batches: the per-slot shrink (lora-triton.slot_shrink) with the dense expand, and
    # (with an empty segment) with the per-slot expand.
    TritonLoraBackend(slot_shrink=True, dense_expand=lens[-1] != 0).apply(x, a, b, info, out, offsets)
    assert _rel(out - before.float(), want - before.float()) < 2e-2
    bounds = info.seg_indptr.tolist()
    for seg in (info.weight_indices == 2).nonzero().flatten().tolist():
        rows = slice(bounds[seg], bounds[seg + 1])
        assert torch.equal(out[rows], before[rows]), "rows on the rank-0 slot changed"


def test_apply_graph_replay_follows_the_segments(batch_info: Callable[..., LoraBatchInfo]) -> None:
    """The per-slot shrink and the expand of its partial sums captured in a CUDA graph of 32 rows,
    replayed with 20 one-token segments on other slots and 12 empty ones (padding rows)."""
    torch.manual_seed(4)
    ranks = [16, 8, 0, 16]
    a, b = _pool(ranks, 16, 4096, (4096, 1024, 1024))
    offsets = [0, 4096, 5120, 6144]
    info = batch_info([1] * 32, [i % 4 for i in range(32)], ranks, DEV)
    x = torch.randn(32, 4096, device=DEV).bfloat16()
    out = torch.zeros(32, 6144, device=DEV).bfloat16()
    backend = TritonLoraBackend(slot_shrink=True, dense_expand=True)
    backend.apply(x, a, b, info, out, offsets)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.apply(x, a, b, info, out, offsets)
    indptr = torch.zeros(33, dtype=torch.int32)
    indptr[1:21] = torch.arange(1, 21, dtype=torch.int32)
    indptr[21:] = 20
    info.seg_indptr.copy_(indptr.to(DEV))
    info.weight_indices.copy_(torch.randint(0, 4, (32,), dtype=torch.int32, device=DEV))
    x.copy_(torch.randn(32, 4096, device=DEV).bfloat16())
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = torch.zeros(32, 6144, device=DEV)
    reference_expand(reference_shrink(x, a, info), b, info, want, offsets)
    assert _rel(out, want) < 2e-2
    assert not out[20:].any(), "padding tokens were written"


# (segments captured, segments of the replay): same count, the replay's within the captured
# max_seg_len; tokens past the replay's last segment are padding.
GRAPH_CASES = {"decode": ([1] * 32, [1] * 20 + [0] * 12), "chunks": ([16, 16], [5, 11])}


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_cuda_graph_replay_follows_the_segments(case: str, batch_info: Callable[..., LoraBatchInfo]) -> None:
    torch.manual_seed(3)
    captured, replayed = GRAPH_CASES[case]
    ranks = [16, 8, 0, 16]
    a, b = _pool(ranks, 16, 4096, (4096, 1024, 1024))
    offsets = [0, 4096, 5120, 6144]
    tokens = sum(captured)
    info = batch_info(captured, [i % 4 for i in range(len(captured))], ranks, DEV)
    x = torch.randn(tokens, 4096, device=DEV).bfloat16()
    out = torch.zeros(tokens, 6144, device=DEV).bfloat16()
    backend = TritonLoraBackend()
    backend.expand(backend.shrink(x, a, info), b, info, out, offsets)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = backend.shrink(x, a, info)
        backend.expand(y, b, info, out, offsets)
    # A new batch in the same buffers, on other slots (the engine refills them before a replay).
    real = sum(replayed)
    indptr = torch.zeros(len(replayed) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(replayed, dtype=torch.int32), 0)
    info.seg_indptr.copy_(indptr.to(DEV))
    info.weight_indices.copy_(torch.randint(0, 4, (len(replayed),), dtype=torch.int32, device=DEV))
    x.copy_(torch.randn(tokens, 4096, device=DEV).bfloat16())
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(y[:real], reference_shrink(x, a, info)[:real]) < 1e-2
    want = torch.zeros(tokens, 6144, device=DEV)
    reference_expand(y, b, info, want, offsets)
    assert _rel(out, want) < 1e-2
    assert not out[real:].any(), "padding tokens were written"
