"""The LM head projection takes the platform's skinny GEMM for few rows (decode at small batch)
and ``F.linear`` otherwise, with the same logits; vocabulary padding is cut off either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.layers import logits_processor
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


def _decode_batch() -> Any:
    from types import SimpleNamespace

    from engine.model_executor.forward_batch import ForwardMode

    return SimpleNamespace(forward_mode=ForwardMode.DECODE, return_logprob=False, capture_hidden=None)


def test_decode_logits_are_written_into_decode_out() -> None:
    """With ``decode_out`` set (a decode graph sharing its logits buffer), decode logits are the
    buffer, with the values of the default path, logit scale and softcap applied in place."""
    vocab, hidden, rows = 100, 32, 3
    head = _head(vocab + 12, hidden)  # a padded vocabulary: the padding is cut off either way
    h = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for scale, cap in ((1.0, 0.0), (0.5, 30.0)):
        proc = LogitsProcessor(vocab, logit_scale=scale, final_logit_softcap=cap)
        want = proc(h, head, _decode_batch()).next_token_logits
        buf = torch.full((rows + 2, vocab), float("nan"))
        proc.decode_out = buf[:rows]
        got = proc(h, head, _decode_batch()).next_token_logits
        assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want)
        assert torch.equal(buf[:rows], want) and buf[rows:].isnan().all()
    proc.decode_out = torch.empty(rows, vocab + 12)
    with pytest.raises(ValueError, match=r"decode_out.*accepted: float32 of the logits' shape"):
        proc(h, head, _decode_batch())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU")
def test_float32_gemm_on_cuda() -> None:
    """On an NVIDIA GPU, more rows than the skinny kernel takes: one GEMM with float32 output (into
    ``decode_out`` when set), the bf16 path's logits up to their bf16 rounding; a padded vocabulary
    keeps the bf16 GEMM, widened."""
    vocab, hidden, rows = 1000, 64, 24
    head = _head(vocab, hidden).cuda()
    h = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    proc = LogitsProcessor(vocab)
    assert proc._float32_gemm_applies(h, head.weight)
    want = torch.mm(h, head.weight.t(), out_dtype=torch.float32)
    got = proc(h, head, _decode_batch()).next_token_logits
    assert got.dtype == torch.float32 and torch.equal(got, want)
    torch.testing.assert_close(got, F.linear(h, head.weight).float(), rtol=2**-8, atol=1e-3)
    buf = torch.full((rows + 3, vocab), float("nan"), device="cuda")
    proc.decode_out = buf[:rows]
    assert proc(h, head, _decode_batch()).next_token_logits.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:rows], want) and buf[rows:].isnan().all()
    padded = LogitsProcessor(vocab - 8)
    assert not padded._float32_gemm_applies(h, head.weight)
    assert torch.equal(padded(h, head, _decode_batch()).next_token_logits, F.linear(h, head.weight).float()[:, :-8])
    assert not proc._float32_gemm_applies(h[:0], head.weight) and not proc._float32_gemm_applies(h.float(), head.weight)
    for switch in ("FLOAT32_LM_HEAD_GEMM", "_MM_HAS_OUT_DTYPE"):  # off, or a torch without mm's out_dtype
        with pytest.MonkeyPatch.context() as mp:  # the bf16 GEMM, widened after
            mp.setattr(logits_processor, switch, False)
            assert not proc._float32_gemm_applies(h, head.weight)
            assert torch.equal(proc(h, head, _decode_batch()).next_token_logits, F.linear(h, head.weight).float())
