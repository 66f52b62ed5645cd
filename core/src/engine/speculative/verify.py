"""Chain verification: which drafts the target keeps, and the token it adds.

Every request row ran ``1 + len(drafts)`` positions through the target (its last accepted
token, then its drafts). Position ``j`` of the row gives the target's distribution of the
token after draft ``j - 1``. Greedy rows keep the longest prefix of drafts equal to the
target's argmax, then add the argmax at the first disagreement (or after the last draft: the
"bonus" token), so the output equals plain greedy decoding token for token.

Sampled rows use rejection sampling with a deterministic draft (the draft distribution ``q``
is a point mass on the proposed token ``d``): ``d`` is kept with probability ``p(d)``; on
rejection the token is drawn from the residual ``max(p - q, 0)``, which is ``p`` with ``d``
removed. Each emitted token is then distributed exactly as ``p``: P(d) = p(d) from acceptance,
P(x != d) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x). ``p`` is the sampler's distribution
(temperature, top-k, top-p, min-p, logit_bias), ``engine.layers.sampler.sampling_probs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.layers.sampler import sampling_probs

if TYPE_CHECKING:
    from engine.sampling.sampling_batch_info import SamplingBatchInfo


def draft_tensor(drafts: Sequence[Sequence[int]], width: int, device: torch.device | str) -> torch.Tensor:
    """``[rows, width]`` int64 drafts, each row left-aligned and padded with -1."""
    flat: list[int] = []
    for d in drafts:
        flat.extend(d)
        flat.extend([-1] * (width - len(d)))
    return torch.tensor(flat, dtype=torch.int64).view(len(drafts), width).to(device, non_blocking=True)


def verify_rows(logits: torch.Tensor, drafts: torch.Tensor,
                info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification on the device, rows padded to one length (no host sync).

    Args:
        logits: ``[rows, T, vocab]``: row i's logits at its last accepted token and its drafts
            (positions past ``1 + len(drafts_i)`` are padding, never read as accepted).
        drafts: ``[rows, T - 1]`` int64, -1 where a row has no draft (``draft_tensor``).
        info: one sampling row per request (temperatures, top-k/p, min-p, logit_bias).
    Returns:
        ``kept`` ``[rows]``: drafts kept (a prefix); ``final`` ``[rows]``: the target's token
        after them.
    """
    rows, t, vocab = logits.shape
    logits = logits.float()
    if info.logit_bias is not None:
        logits = logits + info.logit_bias.view(rows, 1, vocab)
    target = torch.argmax(logits, dim=-1)  # [rows, T]
    has = drafts >= 0
    safe = drafts.clamp(min=0)
    accept = target[:, : t - 1] == drafts
    probs = None
    if not info.is_all_greedy:
        pinfo = info.filter([r for r in range(rows) for _ in range(t)])
        probs = sampling_probs(logits.view(rows * t, vocab), pinfo).view(rows, t, vocab)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        p_draft = probs[:, : t - 1].gather(2, safe.unsqueeze(2)).squeeze(2)
        uniform = torch.rand(p_draft.shape, device=logits.device)
        accept = torch.where(info.greedy_mask.view(rows, 1), accept, uniform < p_draft)
    accept &= has
    kept = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    final = target.gather(1, kept.view(rows, 1)).view(rows)
    if probs is not None:
        p = probs.gather(1, kept.view(rows, 1, 1).expand(rows, 1, vocab)).view(rows, vocab)
        # The draft at the first rejected position (none when every draft was kept: then the
        # target's own distribution is sampled as is).
        rejected = (kept < has.sum(dim=1)).view(rows, 1)
        rejected_draft = torch.cat([safe, safe.new_zeros(rows, 1)], dim=1).gather(1, kept.view(rows, 1))
        # Residual of a point-mass draft: p without the rejected token.
        p = p.scatter(1, rejected_draft, torch.where(rejected, torch.zeros_like(p[:, :1]),
                                                     p.gather(1, rejected_draft)))
        noise = torch.empty_like(p).exponential_()
        sampled = torch.argmax(p / noise, dim=-1)
        final = torch.where(info.greedy_mask, final, sampled)
    return kept, final


def pad_positions(lens: Sequence[int], width: int) -> list[int]:
    """Indices into ragged rows (row i: ``lens[i]`` positions, back to back) that lay them out as
    ``[rows, width]``, each row's last position repeated as padding."""
    idx: list[int] = []
    start = 0
    for n in lens:
        idx.extend(start + min(j, n - 1) for j in range(width))
        start += n
    return idx


def verify_chain(logits: torch.Tensor, drafts: Sequence[Sequence[int]],
                 info: SamplingBatchInfo) -> list[list[int]]:
    """The tokens each row appends: its kept drafts, then one token of the target's.

    Args:
        logits: ``[sum(1 + len(d)), vocab]`` float logits at every verified position, rows
            in order.
        drafts: the drafts of each row.
        info: the rows' sampling state (one row per request; no penalizer, grammar mask or
            per-request seed: the speculator does not speculate for such rows).
    Returns:
        one list per row, ``num_accepted + 1`` tokens long.
    """
    lens = [len(d) + 1 for d in drafts]
    width = max(lens, default=1)
    idx = torch.tensor(pad_positions(lens, width), dtype=torch.int64).to(logits.device)
    padded = logits.index_select(0, idx).view(len(drafts), width, -1)
    kept, final = verify_rows(padded, draft_tensor(drafts, width - 1, logits.device), info)
    kept_host, final_host = torch.stack([kept, final]).tolist()  # the one host sync
    return [list(d[:a]) + [int(t)] for d, a, t in zip(drafts, kept_host, final_host)]
