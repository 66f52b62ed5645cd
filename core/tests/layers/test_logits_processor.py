"""The LM head projection takes the platform's skinny GEMM for few rows (decode at small batch)
and ``F.linear`` otherwise, with the same logits; vocabulary padding is cut off either way."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.layers.logits_processor import LogitsProcessor
from engine.layers.vocab_parallel_embedding import ParallelLMHead


class _OnGpu(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` like one on the GPU (the dispatch checks it)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class _Recorder:
    """Stands for ``layer_kernels()['linear']``; records the row counts it is called with."""

    max_rows = 4

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return F.linear(x.as_subclass(torch.Tensor), weight, bias)


def _head(vocab: int, hidden: int) -> Any:
    head = ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16)
    head.weight.data.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0)))
    return head


def test_lm_head_uses_the_skinny_kernel_for_few_rows_only() -> None:
    vocab, hidden = 100, 32
    head = _head(vocab, hidden)
    proc = LogitsProcessor(vocab)
    kernel = _Recorder()
    proc.use_kernels({"rms_norm": object(), "linear": kernel})
    for rows in (1, 4, 5):
        h = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        got = proc._project(h.as_subclass(_OnGpu), head)
        want = torch.matmul(h, head.weight.t()).float()[:, :vocab]
        assert got.shape == (rows, vocab) and torch.equal(got.as_subclass(torch.Tensor), want)
    assert kernel.rows == [1, 4]  # 5 rows: over the kernel's max_rows, plain GEMM
    proc._project(torch.randn(2, hidden).to(torch.bfloat16), head)  # on the CPU: never the kernel
    assert kernel.rows == [1, 4]
    plain = LogitsProcessor(vocab)
    plain.use_kernels({"rms_norm": object()})  # a platform without the kernel
    assert plain.skinny_linear is None
