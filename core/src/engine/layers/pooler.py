"""Pooling of token hidden states into one vector per request (embedding and scoring models).

A request's prompt may reach the model in several chunks (chunked prefill) and, for last-token
pooling on a decoder, after a cached prefix; ``PoolState`` keeps a running reduction so the
vector is the same either way. ``Pooler.finish`` applies the model's head (scoring models),
Matryoshka truncation and L2 normalisation, in that order: a truncated vector is normalised
after truncation, so it has unit length like the full one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.pooling import POOLING_METHODS


@dataclass
class PoolState:
    """The running reduction of one request's token states (float32, on the model's device)."""

    # "cls": the first token's state; "mean": the sum so far; "max": the maximum; "last": the latest.
    value: torch.Tensor | None = None
    # Tokens reduced so far (the mean's divisor).
    count: int = 0


class Pooler:
    """Pools per-request token states: ``add`` per chunk, ``finish`` once per request.

    Args:
        method: one of ``POOLING_METHODS``.
        normalize: L2-normalise the returned vectors.
        head: applied to the pooled state before truncation (a scoring model's classifier).
    """

    def __init__(self, method: str, normalize: bool, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if method not in POOLING_METHODS:
            raise ValueError(f"pooling method {method!r}; accepted: {', '.join(POOLING_METHODS)}")
        self.method = method
        self.normalize = normalize
        self.head = head

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt token's state is needed (no cached prefix may be skipped)."""
        return self.method != "last"

    def add(self, state: PoolState, hidden: torch.Tensor) -> None:
        """Reduces the next ``[n, hidden]`` states of a request's prompt into ``state``."""
        if hidden.shape[0] == 0:
            return
        h = hidden.float()
        if self.method == "cls":
            if state.value is None:
                state.value = h[0].clone()
        elif self.method == "mean":
            total = h.sum(dim=0)
            state.value = total if state.value is None else state.value + total
        elif self.method == "max":
            peak = h.max(dim=0).values
            state.value = peak if state.value is None else torch.maximum(state.value, peak)
        else:
            state.value = h[-1].clone()
        state.count += int(h.shape[0])

    def add_batch(self, states: list[PoolState], hidden: torch.Tensor, lens: list[int]) -> None:
        """``add`` for each row of a packed ``[sum(lens), hidden]`` batch."""
        start = 0
        for state, n in zip(states, lens):
            self.add(state, hidden[start : start + n])
            start += n

    def finish(self, states: list[PoolState], dimensions: list[int | None]) -> list[torch.Tensor]:
        """The vectors (float32, on the CPU) of finished requests, each cut to its ``dimensions``."""
        if not states:
            return []
        pooled = []
        for state in states:
            assert state.value is not None and state.count > 0, "a request finished before any token was pooled"
            pooled.append(state.value / state.count if self.method == "mean" else state.value)
        vectors = torch.stack(pooled)
        if self.head is not None:
            with torch.inference_mode():
                vectors = self.head(vectors).float()
        out = []
        for vector, dims in zip(vectors.cpu(), dimensions):
            if dims is not None:
                vector = vector[:dims]
            if self.normalize:
                vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
            out.append(vector)
        return out


def pool(hidden: torch.Tensor, lens: list[int], method: str, normalize: bool,
         dimensions: list[int | None] | None = None) -> list[torch.Tensor]:
    """One-shot pooling of a packed batch (every row's whole prompt present)."""
    pooler = Pooler(method, normalize)
    states = [PoolState() for _ in lens]
    pooler.add_batch(states, hidden, lens)
    return pooler.finish(states, dimensions or [None] * len(lens))


__all__ = ["POOLING_METHODS", "PoolState", "Pooler", "pool"]
