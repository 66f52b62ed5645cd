"""Chain and tree verification: which drafts the target keeps, and the token it adds (trees:
``verify_tree``).

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


def verify_tree(logits: torch.Tensor, rows: Sequence[tuple[Sequence[int], Sequence[int]]],
                info: SamplingBatchInfo) -> list[tuple[list[int], int]]:
    """Tree verification: the path each row keeps and the target's token after it.

    Row ``i`` ran its nodes ``rows[i] = (tokens, parents)`` (node 0 the last accepted token,
    parent -1; ``engine.speculative.tree``); the logits at node ``u`` are the target's
    distribution of the token after the path root .. ``u``.

    **Greedy rows** walk from the root: at node ``u`` take the first child whose token equals
    the argmax at ``u``; stop where none does and append that argmax (the bonus token). Every
    step takes the token plain greedy decoding would, so the output is the plain output.

    **Sampled rows** walk with multi-candidate rejection sampling for point-mass drafts. At
    node ``u`` with children ``c_1 .. c_m`` (in node order) and the sampler's distribution
    ``p`` at ``u`` (``sampling_probs``, normalised), a residual ``r`` starts as ``p``; child
    ``c_k`` is accepted with probability ``r(c_k) / S_k`` where ``S_k = sum(r)`` before it; on
    rejection ``r(c_k) = 0``. If every child is rejected the token is drawn from ``r / sum(r)``.

    *Each emitted token is distributed as p.* Rejecting ``c_k`` happens with probability
    ``1 - r(c_k) / S_k = S_{k+1} / S_k``, so child ``k`` is reached with probability
    ``prod_{i<k} S_{i+1} / S_i = S_k / S_1 = S_k``. A token ``x`` is emitted by accepting the
    first child carrying it, say ``c_k``, with probability ``S_k * r_k(x) / S_k = r_k(x) = p(x)``
    (no earlier child carried ``x``, so ``r_k(x) = p(x)``); later children carrying ``x`` have
    ``r(x) = 0``. Otherwise ``x`` is emitted from the residual, reached with probability
    ``S_{m+1}``: ``S_{m+1} * r_{m+1}(x) / S_{m+1} = r_{m+1}(x)``, which is ``p(x)`` when no child
    carries ``x`` and 0 when one does. Either way ``P(x) = p(x)``. After an accepted child the walk
    repeats at that child with the target's distribution there, which is the next token's law
    given the tokens emitted so far: the output is distributed as sampling from the target.

    Returns:
        per row, ``(path, token)``: ``path`` the kept nodes in order, starting with node 0 (so
        ``len(path) - 1`` drafts were kept), ``token`` the target's token after the path.
    """
    n_rows = len(rows)
    starts, row_of_node, flat_tokens, parent_node = [], [], [], []
    for i, (tokens, parents) in enumerate(rows):
        start = len(row_of_node)
        starts.append(start)
        row_of_node.extend([i] * len(tokens))
        flat_tokens.extend(tokens)
        parent_node.extend(start + (p if p >= 0 else j) for j, p in enumerate(parents))
    device = logits.device
    logits = logits.float()
    node_rows = torch.tensor(row_of_node, dtype=torch.int64).to(device)
    if info.logit_bias is not None:
        logits = logits + info.logit_bias.index_select(0, node_rows)
    target = torch.argmax(logits, dim=-1)
    parts = [target.double(), info.greedy_mask.double()]
    probs = None
    if not info.is_all_greedy:
        probs = sampling_probs(logits, info.filter(row_of_node))
        probs = probs / probs.sum(dim=-1, keepdim=True)
        # p_node[c]: the probability of node c's token under its parent's distribution.
        idx = torch.tensor(parent_node, dtype=torch.int64).to(device)
        tok = torch.tensor(flat_tokens, dtype=torch.int64).to(device)
        parts.append(probs.index_select(0, idx).gather(1, tok.view(-1, 1)).view(-1).double())
    host = torch.cat(parts).tolist()  # the walk's one host sync
    n = len(row_of_node)
    target_h, greedy_h = host[:n], host[n: n + n_rows]
    p_node = host[n + n_rows:]
    uniform = torch.rand(n).tolist() if probs is not None else []
    results: list[tuple[list[int], int]] = []
    residual_rows: list[tuple[int, int, list[int]]] = []  # (row, global node, rejected tokens)
    for i, (tokens, parents) in enumerate(rows):
        start = starts[i]
        children: list[list[int]] = [[] for _ in tokens]
        for j, p in enumerate(parents):
            if p >= 0:
                children[p].append(j)
        path = [0]
        u = 0
        if greedy_h[i]:
            while True:
                want = int(target_h[start + u])
                nxt = next((c for c in children[u] if tokens[c] == want), None)
                if nxt is None:
                    break
                u = nxt
                path.append(u)
            results.append((path, int(target_h[start + u])))
            continue
        while True:
            mass, rejected, chosen = 1.0, [], None
            for c in children[u]:
                if tokens[c] in rejected:
                    continue  # its residual is 0: never accepted
                q = p_node[start + c]
                if uniform[start + c] * mass < q:
                    chosen = c
                    break
                rejected.append(tokens[c])
                mass -= q
            if chosen is None:
                break
            u = chosen
            path.append(u)
        results.append((path, -1))
        residual_rows.append((i, start + u, rejected))
    if residual_rows:
        assert probs is not None
        at = torch.tensor([g for _, g, _ in residual_rows], dtype=torch.int64).to(device)
        p = probs.index_select(0, at)
        r = p.clone()
        for k, (_, _, rejected) in enumerate(residual_rows):
            if rejected:
                r[k, torch.tensor(rejected, dtype=torch.int64, device=device)] = 0.0
        # Rounding can leave a positive remaining mass where the children covered p's whole
        # support (then r is all zero): that branch has probability ~0; draw from p there.
        r = torch.where(r.sum(dim=-1, keepdim=True) > 0, r, p)
        sampled = torch.argmax(r / torch.empty_like(r).exponential_(), dim=-1).tolist()
        for (i, _, _), tok_id in zip(residual_rows, sampled):
            results[i] = (results[i][0], int(tok_id))
    return results
