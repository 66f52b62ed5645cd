"""Batched sampling state of the running requests, as device tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from engine.sampling.sampling_params import SamplingParams


class SamplingReq(Protocol):
    """What a batch's sampling state is built from: a scheduler request
    (``engine.managers.schedule_batch.Req``), named by what is read so sampling, a layer below the
    scheduler, does not import it."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def origin_input_ids(self) -> list[int]: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def return_logprob(self) -> bool: ...
    @property
    def top_logprobs_num(self) -> int: ...


@dataclass
class SamplingBatchInfo:
    # [bs, 1] temperatures (1.0 on greedy rows, which take the argmax instead).
    temperatures: torch.Tensor
    # [bs] nucleus, top-k (vocab size for "all") and min-p thresholds.
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    # [bs] bool: rows that take the argmax.
    greedy_mask: torch.Tensor
    is_all_greedy: bool
    need_top_p_top_k: bool
    need_min_p: bool
    # Per row: seed for reproducible sampling, or None for the global generator.
    seeds: list[int | None]
    # Per row: tokens generated so far (mixed into the seed so each step differs).
    steps: list[int]
    vocab_size: int
    # Penalizers (frequency, presence, repetition, min_new_tokens), or None when unused.
    penalizer: Any = None
    # Per row: return logprobs, and how many top alternatives.
    return_logprob: bool = False
    top_logprobs_nums: list[int] | None = None
    # [bs, vocab] float32 added to the logits (OpenAI logit_bias), or None when no row has one.
    logit_bias: torch.Tensor | None = None
    # Structured output, set every step by the scheduler's GrammarQueue (None: no constrained
    # row): [bs, ceil(vocab/32)] int32 token bitmask on the device, and the grammar backend's
    # batched apply(logits, bitmask).
    vocab_mask: torch.Tensor | None = None
    apply_vocab_mask: Any = None

    def filter(self, keep: list[int]) -> SamplingBatchInfo:
        """The rows ``keep`` of this batch (penalty state carried over)."""
        idx = torch.tensor(keep, dtype=torch.int64, device=self.temperatures.device)
        greedy = self.greedy_mask.index_select(0, idx)
        if self.penalizer is not None:
            self.penalizer.filter(keep)
        return SamplingBatchInfo(
            temperatures=self.temperatures.index_select(0, idx), top_ps=self.top_ps.index_select(0, idx),
            top_ks=self.top_ks.index_select(0, idx), min_ps=self.min_ps.index_select(0, idx),
            greedy_mask=greedy, is_all_greedy=self.is_all_greedy,
            need_top_p_top_k=self.need_top_p_top_k, need_min_p=self.need_min_p,
            seeds=[self.seeds[i] for i in keep], steps=[self.steps[i] for i in keep],
            vocab_size=self.vocab_size, penalizer=self.penalizer, return_logprob=self.return_logprob,
            top_logprobs_nums=[self.top_logprobs_nums[i] for i in keep] if self.top_logprobs_nums else None,
            logit_bias=self.logit_bias.index_select(0, idx) if self.logit_bias is not None else None)

    @classmethod
    def from_reqs(cls, reqs: list[SamplingReq], vocab_size: int, device: torch.device,
                  eos_token_ids: set[int] | None = None) -> SamplingBatchInfo:
        params = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        info = cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).view(-1, 1),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            is_all_greedy=all(greedy),
            need_top_p_top_k=any(p.top_p < 1.0 or 0 < p.top_k < vocab_size for p in params),
            need_min_p=any(p.min_p > 0 for p in params),
            seeds=[p.seed for p in params],
            steps=[len(r.output_ids) for r in reqs],
            vocab_size=vocab_size,
            return_logprob=any(r.return_logprob for r in reqs),
            top_logprobs_nums=[r.top_logprobs_num for r in reqs],
        )
        info.penalizer = _make_penalizer(reqs, vocab_size, device, eos_token_ids or set())
        info.logit_bias = _logit_bias(params, vocab_size, device)
        return info


def _logit_bias(params: list[Any], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    if not any(p.logit_bias for p in params):
        return None
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32)
    for row, p in enumerate(params):
        for token_id, value in (p.logit_bias or {}).items():
            if 0 <= token_id < vocab_size:  # checked against the vocabulary upstream
                bias[row, token_id] = float(value)
    return bias.to(device, non_blocking=True)


def _make_penalizer(reqs: list[SamplingReq], vocab_size: int, device: torch.device, eos: set[int]) -> Any:
    from engine.sampling.penalizers import BatchedPenalizerOrchestrator

    orchestrator = BatchedPenalizerOrchestrator(vocab_size, device, reqs, eos)
    return orchestrator if orchestrator.is_required else None
