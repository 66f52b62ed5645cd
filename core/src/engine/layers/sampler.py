"""Turns last-position logits into next tokens (and their logprobs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class SampleOutput:
    # [bs] sampled token ids.
    next_token_ids: torch.Tensor
    # [bs] logprob of each sampled token under the model's raw distribution (or None).
    next_token_logprobs: torch.Tensor | None = None
    # [bs, k] top-k logprobs and their token ids (k = max requested), or None.
    top_logprobs: torch.Tensor | None = None
    top_logprob_ids: torch.Tensor | None = None


def _seeded_exponential(seed: int, step: int, n: int, device: torch.device) -> torch.Tensor:
    # One generator per (seed, step): the draw depends on nothing else, so a seeded
    # request samples the same tokens whatever batch it runs in.
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed * 1_000_003 + step) % (2**63 - 1))
    return torch.empty(n, dtype=torch.float32).exponential_(generator=gen).to(device)


def sampling_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The distribution a sampled row draws from: softmax at its temperature, then top-k,
    top-p and min-p applied (unnormalised after filtering; sampling and speculative
    verification both normalise implicitly). ``logits`` already carry penalties and biases."""
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_top_p_top_k or info.need_min_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
        drop = ranks >= info.top_ks.view(-1, 1)
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) > info.top_ps.view(-1, 1)
        if info.need_min_p:
            drop |= sorted_probs < sorted_probs[:, :1] * info.min_ps.view(-1, 1)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return probs


class Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        #: the platform's ``layer_kernels()['argmax']`` (``torch.argmax(logits, dim=-1)`` in one
        #: launch) for logits on its device; None: torch.argmax.
        self.argmax_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        self.argmax_kernel = kernels.get("argmax")

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # Platform kernels run on the platform's device; CPU logits (the cpu platform, tests) stay
        # with torch.
        if self.argmax_kernel is not None and logits.device.type != "cpu":
            return self.argmax_kernel(logits)
        return torch.argmax(logits, dim=-1)

    def forward(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        """``logits``: ``[bs, vocab]`` float32 (modified in place by penalties)."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if info.return_logprob else None
        if info.penalizer is not None:
            info.penalizer.apply(logits)
        if info.logit_bias is not None:
            logits += info.logit_bias
        if info.vocab_mask is not None:
            # Structured output: disallowed tokens to -inf, the whole batch in one op (outside
            # any CUDA graph: the graph ends at the logits).
            info.apply_vocab_mask(logits, info.vocab_mask)
        if info.is_all_greedy:
            ids = self._argmax(logits)
        else:
            ids = self._sample(logits, info)
        out = SampleOutput(next_token_ids=ids)
        if raw_logprobs is not None:
            out.next_token_logprobs = raw_logprobs.gather(1, ids.view(-1, 1)).view(-1)
            k = max(info.top_logprobs_nums or [0])
            if k > 0:
                out.top_logprobs, out.top_logprob_ids = raw_logprobs.topk(k, dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        greedy_ids = self._argmax(logits)
        probs = sampling_probs(logits, info)
        # Sampling by argmax(p / E), E ~ Exp(1), draws index i with probability p_i.
        noise = torch.empty_like(probs).exponential_()
        for row, seed in enumerate(info.seeds):
            if seed is not None:
                noise[row] = _seeded_exponential(seed, info.steps[row], probs.shape[-1], probs.device)
        sampled = torch.argmax(probs / noise, dim=-1)
        return torch.where(info.greedy_mask, greedy_ids, sampled)
