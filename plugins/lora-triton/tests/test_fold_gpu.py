"""The folded expand on a CUDA GPU at Llama-3-8B's shapes (qkv, gate_up, down; ranks 16 and 64;
bfloat16), compiled, against the float32 torch loop of shrink-then-expand on the unfolded layer:
decode batches of 64 and 1, a padded decode batch, a 128-token prefill and a mixed batch; and in
a CUDA graph replayed after the batch's slots change in place, as the engine's decode does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from engine_lora_triton.backend import TritonLoraBackend

from engine.lora.backend import LoraBatchInfo, reference_expand, reference_shrink
from engine.testing.conformance.lora import random_pool_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
SLOTS = 9
LAYERS = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


def _layer(r: int, k: int, widths: tuple[int, ...], ranks: list[int]) -> tuple[torch.Tensor, ...]:
    n, s = sum(widths), len(widths)
    w = torch.randn(n, k, device=DEV) / k ** 0.5
    # (a rank-0 slot keeps stale weights, an unloaded adapter's)
    a, b = random_pool_weights(torch.default_generator, s, k, n, torch.device(DEV), torch.bfloat16, tuple(ranks), r)
    offsets = [0]
    for width in widths:
        offsets.append(offsets[-1] + width)
    return w.bfloat16(), a, b, offsets


def _unfolded(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, info: LoraBatchInfo,
              offsets: list[int]) -> torch.Tensor:
    out = F.linear(x, w).float()
    reference_expand(reference_shrink(x, a, info), b, info, out, offsets)
    return out


def _rel(got: torch.Tensor, want: torch.Tensor, rows: int) -> float:
    got, want = got[:rows].float(), want[:rows].float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("r", [16, 64])
@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("lens", [[1] * 64, [1], [1] * 60 + [0] * 4, [128], [5, 0, 60, 1]],
                         ids=["decode-64", "decode-1", "decode-padded", "prefill-128", "mixed"])
def test_fold_llama_shapes(r: int, layer: str, lens: list[int], batch_info: Callable[..., LoraBatchInfo]) -> None:
    torch.manual_seed(r + len(lens))
    ranks = [r, r // 2, 0] + [r] * (SLOTS - 3)
    k, widths = LAYERS[layer]
    w, a, b, offsets = _layer(r, k, widths, ranks)
    info = batch_info(lens, [i * 5 % SLOTS for i in range(len(lens))], ranks, DEV)
    info.one_token_segments = set(lens) == {1}  # the engine's decode batches
    tokens = sum(lens) + (4 if lens[-1] == 0 else 0)  # padding rows past the last segment
    x = torch.randn(tokens, k, device=DEV).bfloat16()
    h = F.linear(x, torch.cat([w, a.reshape(-1, k)]))
    got = TritonLoraBackend().fold_expand(h, b, info, offsets)
    assert got.shape == (tokens, offsets[-1]) and got.is_contiguous()
    assert _rel(got, _unfolded(x, w, a, b, info, offsets), tokens) < 2e-2
    # Padding rows keep the base output.
    torch.testing.assert_close(got[sum(lens):], h[sum(lens):, :offsets[-1]])


def test_fold_graph_replay_follows_the_slots(batch_info: Callable[..., LoraBatchInfo]) -> None:
    torch.manual_seed(1)
    ranks = [16] * (SLOTS - 1) + [0]
    k, widths = LAYERS["qkv"]
    w, a, b, offsets = _layer(16, k, widths, ranks)
    info = batch_info([1] * 64, [i % 8 for i in range(64)], ranks, DEV)
    info.one_token_segments = True
    x = torch.randn(64, k, device=DEV).bfloat16()
    # As LoRA layers run it: the last slot, the base model's (rank 0), left out of the GEMM.
    w_fold = torch.cat([w, a[:-1].reshape(-1, k)])
    backend = TritonLoraBackend()
    backend.fold_expand(F.linear(x, w_fold), b, info, offsets)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.fold_expand(F.linear(x, w_fold), b, info, offsets)
    for step in range(3):
        info.weight_indices.copy_(torch.randint(0, SLOTS, (64,), device=DEV, dtype=torch.int32))
        x.copy_(torch.randn(64, k, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, _unfolded(x, w, a, b, info, offsets), 64) < 2e-2, step
