"""Decode captured in a CUDA graph and replayed with new lengths matches eager decode."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]

HEAD_DIM = 64
MAX_BS = 8


def _setup(num_heads: int, num_kv_heads: int, page_size: int):  # type: ignore[no-untyped-def]
    from engine import plugins
    from engine.attention import AttentionContext
    from engine.hookspecs import resolve_factory
    from engine.mem_cache.memory_pool import (
        MHATokenToKVPool,
        ReqToTokenPool,
        TokenToKVPoolAllocator,
    )

    device = torch.device("cuda")
    dtype = torch.bfloat16
    r2t = ReqToTokenPool(MAX_BS + 1, 512, device)
    kv = MHATokenToKVPool(8192, page_size, dtype, num_kv_heads, HEAD_DIM, 2, device)
    for layer in range(2):
        kv.k_buffer[layer].normal_()
        kv.v_buffer[layer].normal_()
    alloc = TokenToKVPoolAllocator(8192, page_size, device)
    alloc.free_pages = alloc.free_pages[torch.randperm(len(alloc.free_pages), device=device)]
    # Every request slot gets a full-length row of scattered KV slots up front.
    slots = r2t.alloc(MAX_BS)
    for s in slots:
        r2t.write(s, 0, alloc.alloc_extend([0], [400], [-1]))
    ctx = AttentionContext(device=device, dtype=dtype, num_layers=2, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, page_size=page_size,
                           max_context_len=512, req_to_token_pool=r2t, token_to_kv_pool=kv)
    backend = resolve_factory(plugins.get_attention_backend("flashinfer").factory)(ctx)
    return backend, r2t, kv, slots


def _decode_batch(slots: list[int], lens: list[int], kv):  # type: ignore[no-untyped-def]
    from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

    loc = torch.zeros(len(lens), dtype=torch.int64)
    fb = ForwardBatch.build(ForwardMode.DECODE, [0] * len(lens), slots, lens, [n - 1 for n in lens],
                            loc, "cuda")
    fb.token_to_kv_pool = kv
    return fb


@pytest.mark.parametrize("num_heads", [4, 8])  # GQA group 2 (CUDA cores) and 4 (tensor cores)
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_replay_matches_eager(num_heads: int, page_size: int) -> None:
    from engine.layers.radix_attention import RadixAttention
    from engine.testing.reference import reference_attention

    num_kv_heads = 2
    backend, r2t, kv, slots = _setup(num_heads, num_kv_heads, page_size)
    # Two layers with different plan-time settings: one wrapper per key in each graph.
    layers = [
        RadixAttention(num_heads, HEAD_DIM, HEAD_DIM**-0.5, num_kv_heads, 0),
        RadixAttention(num_heads, HEAD_DIM, HEAD_DIM**-0.5, num_kv_heads, 1, logit_cap=30.0,
                       sliding_window_size=16),
    ]
    backend.warmup(layers)
    backend.init_cuda_graph_state(MAX_BS, MAX_BS)
    fill = backend.get_cuda_graph_seq_len_fill_value()

    bs = 6
    static_q = torch.zeros(bs, num_heads * HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    static_idx = torch.zeros(bs, dtype=torch.int64, device="cuda")
    static_lens = torch.full((bs,), fill, dtype=torch.int64, device="cuda")
    fb = _decode_batch([0] * bs, [fill] * bs, kv)
    backend.init_forward_metadata_capture_cuda_graph(bs, static_idx, static_lens)

    def step() -> list[torch.Tensor]:
        return [backend.forward_decode(static_q, None, None, layer, fb, save_kv_cache=False)
                for layer in layers]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up launch outside the graph, as graph runners do
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    rng = random.Random(page_size * 10 + num_heads)
    for real in (bs, 4):  # a full batch, then one padded with two dummy rows
        lens = [rng.randint(1, 400) for _ in range(real)]
        rows = slots[:real]
        q = torch.randn(real, num_heads * HEAD_DIM, device="cuda").to(torch.bfloat16)
        static_q.zero_()
        static_q[:real] = q
        static_idx.copy_(torch.tensor(rows + [0] * (bs - real)))
        padded = lens + [fill] * (bs - real)
        static_lens.copy_(torch.tensor(padded))
        backend.init_forward_metadata_replay_cuda_graph(bs, static_idx, static_lens, padded)
        graph.replay()
        torch.cuda.synchronize()

        eager_fb = _decode_batch(rows, lens, kv)
        backend.init_forward_metadata(eager_fb)
        for li, layer in enumerate(layers):
            eager = backend.forward_decode(q, None, None, layer, eager_fb, save_kv_cache=False)
            got = static_out[li][:real]
            assert (got.float() - eager.float()).abs().max().item() <= 2e-2, f"layer {li}: graph != eager"
            for i in range(real):
                kv_rows = r2t.req_to_token[rows[i], : lens[i]].long()
                ref = reference_attention(
                    q[i : i + 1].view(1, num_heads, HEAD_DIM), kv.k_buffer[li][kv_rows],
                    kv.v_buffer[li][kv_rows], torch.tensor([lens[i] - 1], device="cuda"),
                    HEAD_DIM**-0.5, layer.sliding_window_size, layer.logit_cap)
                err = (got[i].view(num_heads, HEAD_DIM).double() - ref[0]).abs().max().item()
                assert err <= 2e-2, f"layer {li} row {i}: max abs error {err}"
