"""The sampler takes the platform's argmax kernel (``layer_kernels()['argmax']``) for greedy rows
of logits on a device, and ``torch.argmax`` for CPU logits or when no kernel is offered."""

from __future__ import annotations

import torch

from engine.layers.sampler import Sampler
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.testing.harness import sampling_info


class _OnDevice(torch.Tensor):
    """A CPU tensor that answers ``device`` like one on a GPU (the sampler's check reads it)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


class _FakeArgmax:
    """Stands for the kernel: records the logits' shapes and answers ``argmin``, so ids that came
    from ``torch.argmax`` instead cannot pass for its answer."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(logits.shape))
        return torch.argmin(logits.as_subclass(torch.Tensor), dim=-1)


def _info(*params: dict[str, object], vocab: int) -> SamplingBatchInfo:
    return sampling_info(list(params), vocab)


def _logits(rows: int, vocab: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))


def test_greedy_batches_on_a_device_take_the_kernel() -> None:
    sampler, kernel = Sampler(), _FakeArgmax()
    sampler.use_kernels({"rms_norm": object(), "argmax": kernel})
    logits = _logits(3, 50)
    ids = sampler(logits.clone().as_subclass(_OnDevice), _info(*[{"temperature": 0.0}] * 3, vocab=50)).next_token_ids
    assert kernel.shapes == [(3, 50)]
    assert torch.equal(ids.as_subclass(torch.Tensor), torch.argmin(logits, dim=-1))


def test_mixed_batches_take_the_kernel_for_their_greedy_rows() -> None:
    sampler, kernel = Sampler(), _FakeArgmax()
    sampler.use_kernels({"argmax": kernel})
    logits = _logits(2, 50)
    info = _info({"temperature": 0.0}, {"temperature": 1.0}, vocab=50)
    ids = sampler(logits.clone().as_subclass(_OnDevice), info).next_token_ids
    assert kernel.shapes == [(2, 50)]
    assert int(ids[0]) == int(torch.argmin(logits[0]))  # the greedy row: the kernel's answer


def test_cpu_logits_and_platforms_without_the_kernel_take_torch_argmax() -> None:
    logits = _logits(3, 50)
    info = _info(*[{"temperature": 0.0}] * 3, vocab=50)
    with_kernel, kernel = Sampler(), _FakeArgmax()
    with_kernel.use_kernels({"argmax": kernel})
    assert torch.equal(with_kernel(logits.clone(), info).next_token_ids, torch.argmax(logits, dim=-1))
    assert kernel.shapes == []  # CPU tensors: never the kernel
    without = Sampler()
    without.use_kernels({"rms_norm": object()})
    assert without.argmax_kernel is None
    ids = without(logits.clone().as_subclass(_OnDevice), info).next_token_ids
    assert torch.equal(ids.as_subclass(torch.Tensor), torch.argmax(logits, dim=-1))
