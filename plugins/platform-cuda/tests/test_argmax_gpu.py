"""The greedy argmax kernel compiled on the GPU: equal to ``torch.argmax`` on CUDA at decode shapes
(the Qwen3 and Llama-3 vocabularies, 1..300 rows) in float32, bf16 and fp16, with ties and NaNs;
many calls in a row (each one's ticket reset lets the next reuse the workspace, and a partial read
before another SM's store would show as a wrong id); inside a CUDA graph; and in the engine, where
the sampler takes it and greedy decoding gives the same tokens as with ``torch.argmax``."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from engine.testing.checkpoints import DECODE_KERNEL_MODELS
from engine.testing.harness import generate_greedy, make_scheduler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCABS = [151936, 128256, 32000]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rows(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits with, row by row: a repeated maximum far apart, NaNs, all -inf, plain."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen, device="cuda").clamp(max=5.0)
    pick = torch.randint(0, vocab, (rows, 3), generator=gen, device="cuda")
    for r in range(rows):
        kind = r % 4
        if kind == 0:
            x[r, pick[r]] = 6.0  # three equal maxima
        elif kind == 1:
            x[r, pick[r]] = float("nan")
        elif kind == 2 and r % 8 == 2:
            x[r] = float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, 2, 8, 64, 300])
def test_matches_torch_on_cuda(rows: int, vocab: int, dtype: torch.dtype) -> None:
    from engine_platform_cuda.argmax import argmax_rows

    x = _rows(rows, vocab, dtype, seed=rows * 7 + vocab)
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
    assert torch.equal(argmax_rows(x), torch.argmax(x.cpu(), dim=-1).cuda())


def test_many_calls_in_a_row_stay_exact() -> None:
    """200 launches back to back without a sync, the maximum moving between programs each time."""
    from engine_platform_cuda.argmax import argmax_rows

    x = torch.randn(200, 2, 151936, device="cuda").clamp(max=5.0)
    where = torch.randint(0, 151936, (200, 2), device="cuda")
    x.scatter_(2, where.unsqueeze(-1), 6.0)
    got = torch.stack([argmax_rows(x[i]) for i in range(200)])
    assert torch.equal(got, where)


def test_replays_in_a_cuda_graph() -> None:
    from engine_platform_cuda.argmax import argmax_rows

    x = torch.randn(4, 151936, device="cuda")
    argmax_rows(x)  # the workspace exists before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        argmax_rows(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(x)
    for seed in range(5):
        x.copy_(torch.randn(4, 151936, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, torch.argmax(x, dim=-1))


def _greedy(path: str, kernel: bool) -> tuple[list[list[int]], int]:
    from engine_platform_cuda.argmax import argmax_rows

    sched = make_scheduler(path, platform="cuda", dtype="bfloat16", attention="triton", cuda_graph_max_bs=4,
                           plugin_options={"cuda": {"argmax": True}})
    sampler = sched.runner.sampler
    assert sampler.argmax_kernel is argmax_rows  # handed over by the model runner (cuda.argmax on)
    calls = []

    def counting(logits: torch.Tensor) -> torch.Tensor:
        calls.append(logits.shape[0])
        return argmax_rows(logits)

    sampler.argmax_kernel = counting if kernel else None
    out = generate_greedy(sched, [list(range(5, 10)), list(range(300, 317))], 12, ignore_eos=True)
    del sched
    gc.collect()
    torch.cuda.empty_cache()
    return out, len(calls)


def test_the_engine_samples_greedy_tokens_with_it(tmp_path: Any) -> None:
    from engine.testing.checkpoints import make_tiny_checkpoint

    arch, cfg = DECODE_KERNEL_MODELS["llama"]
    path = make_tiny_checkpoint(str(tmp_path), arch, dtype="bfloat16", seed=7, **cfg)
    with_kernel, calls = _greedy(path, True)
    without, no_calls = _greedy(path, False)
    assert calls > 0 and no_calls == 0
    assert with_kernel == without
