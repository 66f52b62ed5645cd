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


def verify_chain(logits: torch.Tensor, drafts: Sequence[Sequence[int]],
                 info: SamplingBatchInfo) -> list[list[int]]:
    """The tokens each row appends: its kept drafts, then one token of the target's.

    Args:
        logits: ``[sum(1 + len(d)), vocab]`` float logits at every verified position, rows
            in order.
        drafts: the drafts of each row.
        info: the rows' sampling state (one row per request; no penalizer, grammar mask or
            per-request seed: the speculator does not speculate for such batches).
    Returns:
        one list per row, ``num_accepted + 1`` tokens long.
    """
    lens = [len(d) + 1 for d in drafts]
    rep = [row for row, n in enumerate(lens) for _ in range(n)]
    pinfo = info.filter(rep)  # one sampling row per verified position
    logits = logits.float()
    if pinfo.logit_bias is not None:
        logits = logits + pinfo.logit_bias
    device = logits.device
    num_pos = logits.shape[0]
    # The draft proposed at each position (-1 at each row's last position: nothing to check).
    flat: list[int] = []
    for d in drafts:
        flat.extend(d)
        flat.append(-1)
    draft_t = torch.tensor(flat, dtype=torch.int64, device=device)
    has_draft = draft_t >= 0
    safe_draft = draft_t.clamp(min=0).view(-1, 1)
    target_greedy = torch.argmax(logits, dim=-1)
    accept = target_greedy == draft_t
    probs = None
    if not info.is_all_greedy:
        probs = sampling_probs(logits, pinfo)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        p_draft = probs.gather(1, safe_draft).view(-1)
        uniform = torch.rand(num_pos, device=device)
        accept = torch.where(pinfo.greedy_mask, accept, uniform < p_draft)
    accept &= has_draft
    accept_host = accept.tolist()
    # Per row: kept drafts = leading accepted positions.
    starts, offset = [], 0
    for n in lens:
        starts.append(offset)
        offset += n
    kept: list[int] = []
    for start, n in zip(starts, lens):
        a = 0
        while a < n - 1 and accept_host[start + a]:
            a += 1
        kept.append(a)
    final_pos = torch.tensor([s + a for s, a in zip(starts, kept)], dtype=torch.int64, device=device)
    final = target_greedy.index_select(0, final_pos)
    if probs is not None:
        p = probs.index_select(0, final_pos)
        rejected = torch.tensor([a < n - 1 for a, n in zip(kept, lens)], dtype=torch.bool, device=device)
        rejected_draft = draft_t.index_select(0, final_pos).clamp(min=0).view(-1, 1)
        # Residual of a point-mass draft: p without the rejected token.
        p = p.scatter(1, rejected_draft, torch.where(
            rejected.view(-1, 1), torch.zeros_like(p[:, :1]), p.gather(1, rejected_draft)))
        noise = torch.empty_like(p).exponential_()
        sampled = torch.argmax(p / noise, dim=-1)
        final = torch.where(info.greedy_mask, final, sampled)
    final_host = final.tolist()
    return [list(d[:a]) + [int(t)] for d, a, t in zip(drafts, kept, final_host)]
