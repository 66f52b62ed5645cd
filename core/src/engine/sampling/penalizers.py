"""Batched logit penalizers for the running batch (SGLang's penalizer orchestrator).

Each penalty is its own small class holding batch-major tensors (dim 0 = request row). A
penalizer is *prepared* (its tensors allocated) only while some request in the batch uses it, so
a batch of plain requests pays nothing. Rows of requests that do not use a prepared penalizer
hold neutral values, which lets ``apply`` run as one vectorised op over the whole batch.

Order of application (as in vLLM): repetition (multiplicative, over prompt and output), then
frequency and presence (additive, over output), then min_new_tokens (sets stop tokens to -inf,
last so that no other penalty can turn -inf back into a finite value).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class PenaltyParams(Protocol):
    """The fields of a request's sampling params that the penalizers read."""

    @property
    def frequency_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def min_new_tokens(self) -> int: ...
    @property
    def stop_token_ids(self) -> set[int] | None: ...
    @property
    def ignore_eos(self) -> bool: ...


class PenalizerReq(Protocol):
    """What the orchestrator needs from a scheduler request."""

    @property
    def sampling_params(self) -> PenaltyParams: ...
    @property
    def origin_input_ids(self) -> list[int]: ...
    @property
    def output_ids(self) -> list[int]: ...


def _flat_indices(
    seqs: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of ragged per-row token lists, for one batched index_put_."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    cols = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    return rows.to(device), cols.to(device)


class Penalizer:
    """Base class: one penalty over a batch; every tensor in ``_state`` is batch-major."""

    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: set[int]) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        # Empty while unprepared: no tensors exist for a penalty nobody in the batch uses.
        self._state: dict[str, torch.Tensor] = {}

    @property
    def is_prepared(self) -> bool:
        """Whether this penalizer currently holds tensors and takes part in ``apply``."""
        return bool(self._state)

    @staticmethod
    def is_required(params: PenaltyParams) -> bool:
        """Whether a request with these params needs this penalty."""
        raise NotImplementedError

    def _build(self, reqs: Sequence[PenalizerReq]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def prepare(self, reqs: Sequence[PenalizerReq]) -> None:
        """Allocate this penalizer's tensors for ``reqs`` (rows in the same order)."""
        self._state = self._build(reqs)

    def teardown(self) -> None:
        """Release the tensors; the penalizer no longer affects logits."""
        self._state = {}

    def apply(self, logits: torch.Tensor) -> None:
        """Penalize ``logits`` [batch, vocab] in place."""
        raise NotImplementedError

    def cumulate(self, output_ids: torch.Tensor) -> None:
        """Account for one newly sampled token per row (``output_ids`` is [batch] int64)."""
        raise NotImplementedError

    def filter(self, keep: torch.Tensor) -> None:
        """Keep only the rows at indices ``keep`` (a long tensor on this device), in that order."""
        self._state = {name: t[keep] for name, t in self._state.items()}

    def merge(self, other: Penalizer) -> None:
        """Append ``other``'s rows after ours; both must be prepared."""
        self._state = {name: torch.cat([t, other._state[name]]) for name, t in self._state.items()}

    def _per_row(self, values: list[float], dtype: torch.dtype) -> torch.Tensor:
        # Shaped [batch, 1] so that it broadcasts over the vocab dimension.
        return torch.tensor(values, dtype=dtype, device=self.device).unsqueeze(1)


class FrequencyPenalizer(Penalizer):
    """OpenAI frequency penalty: ``logits[t] -= penalty * count of t in the output``."""

    @staticmethod
    def is_required(params: PenaltyParams) -> bool:
        return params.frequency_penalty != 0.0

    def _build(self, reqs: Sequence[PenalizerReq]) -> dict[str, torch.Tensor]:
        penalty = self._per_row([r.sampling_params.frequency_penalty for r in reqs], torch.float32)
        # Kept pre-multiplied (penalty * count) so apply is a single subtraction.
        cumulated = torch.zeros(len(reqs), self.vocab_size, device=self.device)
        seqs = [r.output_ids if self.is_required(r.sampling_params) else [] for r in reqs]
        rows, cols = _flat_indices(seqs, self.device)
        cumulated.index_put_((rows, cols), penalty[rows, 0], accumulate=True)
        return {"penalty": penalty, "cumulated": cumulated}

    def apply(self, logits: torch.Tensor) -> None:
        logits.sub_(self._state["cumulated"])

    def cumulate(self, output_ids: torch.Tensor) -> None:
        self._state["cumulated"].scatter_add_(1, output_ids.unsqueeze(1), self._state["penalty"])


class PresencePenalizer(Penalizer):
    """OpenAI presence penalty: ``logits[t] -= penalty`` once t has appeared in the output."""

    @staticmethod
    def is_required(params: PenaltyParams) -> bool:
        return params.presence_penalty != 0.0

    def _build(self, reqs: Sequence[PenalizerReq]) -> dict[str, torch.Tensor]:
        penalty = self._per_row([r.sampling_params.presence_penalty for r in reqs], torch.float32)
        cumulated = torch.zeros(len(reqs), self.vocab_size, device=self.device)
        seqs = [r.output_ids if self.is_required(r.sampling_params) else [] for r in reqs]
        rows, cols = _flat_indices(seqs, self.device)
        # Plain assignment, not accumulation: a repeated token is penalised once.
        cumulated[rows, cols] = penalty[rows, 0]
        return {"penalty": penalty, "cumulated": cumulated}

    def apply(self, logits: torch.Tensor) -> None:
        logits.sub_(self._state["cumulated"])

    def cumulate(self, output_ids: torch.Tensor) -> None:
        self._state["cumulated"].scatter_(1, output_ids.unsqueeze(1), self._state["penalty"])


class RepetitionPenalizer(Penalizer):
    """HF/CTRL repetition penalty over prompt and output: positive logits / p, others * p."""

    @staticmethod
    def is_required(params: PenaltyParams) -> bool:
        return params.repetition_penalty != 1.0

    def _build(self, reqs: Sequence[PenalizerReq]) -> dict[str, torch.Tensor]:
        penalty = self._per_row([r.sampling_params.repetition_penalty for r in reqs], torch.float32)
        seen = torch.zeros(len(reqs), self.vocab_size, dtype=torch.bool, device=self.device)
        seqs = [
            [*r.origin_input_ids, *r.output_ids] if self.is_required(r.sampling_params) else []
            for r in reqs
        ]
        rows, cols = _flat_indices(seqs, self.device)
        seen[rows, cols] = True
        return {"penalty": penalty, "seen": seen}

    def apply(self, logits: torch.Tensor) -> None:
        penalty = self._state["penalty"]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(self._state["seen"], penalized, logits))

    def cumulate(self, output_ids: torch.Tensor) -> None:
        self._state["seen"].scatter_(1, output_ids.unsqueeze(1), True)


class MinNewTokensPenalizer(Penalizer):
    """Forbid stop tokens (stop_token_ids, and EOS unless ignore_eos) until min_new_tokens."""

    @staticmethod
    def is_required(params: PenaltyParams) -> bool:
        return params.min_new_tokens > 0

    def _stop_ids(self, params: PenaltyParams) -> list[int]:
        ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            ids |= self.eos_token_ids
        # An id past the logits width can never be sampled, so there is nothing to forbid.
        return sorted(t for t in ids if 0 <= t < self.vocab_size)

    def _build(self, reqs: Sequence[PenalizerReq]) -> dict[str, torch.Tensor]:
        stop_ids = [self._stop_ids(r.sampling_params) for r in reqs]
        width = max(1, max((len(ids) for ids in stop_ids), default=0))
        # Rows are padded by repeating their first id so that the scatter in apply never writes
        # two different values to one cell; a row without stop ids gets min_new_tokens 0 so that
        # its padding (id 0) is never forbidden.
        padded = [ids + ids[:1] * (width - len(ids)) if ids else [0] * width for ids in stop_ids]
        min_new = [r.sampling_params.min_new_tokens if ids else 0 for r, ids in zip(reqs, stop_ids)]
        return {
            "stop_ids": torch.tensor(padded, dtype=torch.long, device=self.device).reshape(
                len(reqs), width
            ),
            "min_new": torch.tensor(min_new, dtype=torch.long, device=self.device),
            "generated": torch.tensor(
                [len(r.output_ids) for r in reqs], dtype=torch.long, device=self.device
            ),
        }

    def apply(self, logits: torch.Tensor) -> None:
        stop_ids = self._state["stop_ids"]
        active = (self._state["generated"] < self._state["min_new"]).unsqueeze(1)
        current = logits.gather(1, stop_ids)
        logits.scatter_(1, stop_ids, current.masked_fill(active, float("-inf")))

    def cumulate(self, output_ids: torch.Tensor) -> None:
        self._state["generated"] += 1

    def merge(self, other: Penalizer) -> None:
        mine, theirs = self._state["stop_ids"], other._state["stop_ids"]
        width = max(mine.shape[1], theirs.shape[1])
        self._state["stop_ids"] = _pad_columns(mine, width)
        other._state["stop_ids"] = _pad_columns(theirs, width)
        super().merge(other)


def _pad_columns(ids: torch.Tensor, width: int) -> torch.Tensor:
    # Repeat column 0, which keeps the no-conflicting-writes invariant of MinNewTokensPenalizer.
    return torch.cat([ids, ids[:, :1].expand(-1, width - ids.shape[1])], dim=1)


# Order matters, see the module docstring.
PENALIZER_TYPES: tuple[type[Penalizer], ...] = (
    RepetitionPenalizer,
    FrequencyPenalizer,
    PresencePenalizer,
    MinNewTokensPenalizer,
)


class BatchedPenalizerOrchestrator:
    """All penalizers of one batch, kept row-aligned with ``reqs`` through filter and merge.

    Token counts start from each request's ``output_ids`` at construction (a request may join a
    batch after retraction with tokens already generated); afterwards the owner must call
    ``cumulate_output_tokens`` once per sampled token, in step with appending to ``output_ids``.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        reqs: list[PenalizerReq],
        eos_token_ids: set[int],
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.reqs: list[PenalizerReq] = list(reqs)
        self.penalizers: tuple[Penalizer, ...] = tuple(
            cls(vocab_size, self.device, set(eos_token_ids)) for cls in PENALIZER_TYPES
        )
        for penalizer in self.penalizers:
            if self._needed(penalizer, self.reqs):
                penalizer.prepare(self.reqs)

    @staticmethod
    def _needed(penalizer: Penalizer, reqs: Sequence[PenalizerReq]) -> bool:
        return any(penalizer.is_required(r.sampling_params) for r in reqs)

    @property
    def is_required(self) -> bool:
        """Whether any penalizer is active for any request (else ``apply`` is a no-op)."""
        return any(p.is_prepared for p in self.penalizers)

    def apply(self, logits: torch.Tensor) -> None:
        """Apply every active penalty to ``logits`` [batch, vocab] (float32) in place."""
        if logits.shape != (len(self.reqs), self.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the penalizer batch; "
                f"expected ({len(self.reqs)}, {self.vocab_size})"
            )
        for penalizer in self.penalizers:
            if penalizer.is_prepared:
                penalizer.apply(logits)

    def cumulate_output_tokens(self, output_ids: torch.Tensor) -> None:
        """Record the token just sampled for each request (``output_ids`` is [batch])."""
        ids = output_ids.to(device=self.device, dtype=torch.long).reshape(-1)
        for penalizer in self.penalizers:
            if penalizer.is_prepared:
                penalizer.cumulate(ids)

    def filter(self, keep_indices: torch.Tensor | list[int]) -> None:
        """Keep only the requests at ``keep_indices`` (in that order), e.g. after some finished.

        A penalizer that no remaining request uses is torn down, freeing its tensors.
        """
        if isinstance(keep_indices, torch.Tensor):
            keep_list = [int(i) for i in keep_indices.tolist()]
        else:
            keep_list = list(keep_indices)
        self.reqs = [self.reqs[i] for i in keep_list]
        keep = torch.tensor(keep_list, dtype=torch.long, device=self.device)
        for penalizer in self.penalizers:
            if not penalizer.is_prepared:
                continue
            if self._needed(penalizer, self.reqs):
                penalizer.filter(keep)
            else:
                penalizer.teardown()

    def merge(self, other: BatchedPenalizerOrchestrator) -> None:
        """Append ``other``'s requests after ours (``other`` must not be used afterwards)."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(
                f"cannot merge penalizers with vocab_size {other.vocab_size} into "
                f"vocab_size {self.vocab_size}"
            )
        for mine, theirs in zip(self.penalizers, other.penalizers):
            if not (mine.is_prepared or theirs.is_prepared):
                continue
            # The side that did not need the penalty gets neutral rows for its requests.
            if not mine.is_prepared:
                mine.prepare(self.reqs)
            if not theirs.is_prepared:
                theirs.prepare(other.reqs)
            mine.merge(theirs)
        self.reqs.extend(other.reqs)
