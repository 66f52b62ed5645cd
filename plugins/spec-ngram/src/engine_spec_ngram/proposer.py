"""Prompt-lookup drafting (n-gram matching over the request's prompt and output).

For each request, the last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are
looked up in the earlier tokens; at the most recent earlier occurrence, the tokens that
followed it are the draft. Copy-heavy answers (quoting, rewriting, code edits) repeat long
runs of their prompt, so these drafts are often right; when nothing matches, nothing is
proposed and the step costs what a plain decode step costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.speculative import DraftRequest, Proposer, ProposerContext


def lookup_draft(tokens: np.ndarray, max_draft: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest matching suffix of ``tokens``."""
    n_tok = len(tokens)
    if max_draft <= 0 or n_tok < 2:
        return []
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        # Candidate starts i (i + n < n_tok: the match is not the suffix itself, and a token follows it).
        span = n_tok - n
        hits = np.ones(span, dtype=bool)
        for j in range(n):
            hits &= tokens[j: j + span] == suffix[j]
        starts = np.flatnonzero(hits)
        if len(starts):
            follow = int(starts[-1]) + n
            return tokens[follow: follow + max_draft].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, window: int = 8192) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram options: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        out: list[list[int]] = []
        for req in reqs:
            if req.max_draft <= 0:
                out.append([])
                continue
            history = list(req.prompt_ids[-self.window:]) + list(req.output_ids)
            tokens = np.asarray(history[-self.window:], dtype=np.int64)
            out.append(lookup_draft(tokens, req.max_draft, self.max_ngram, self.min_ngram))
        return out


def create(ctx: ProposerContext, options: dict[str, Any] | None = None) -> NgramProposer:
    opts = options or {}
    return NgramProposer(int(opts.get("max_ngram", 4)), int(opts.get("min_ngram", 1)), int(opts.get("window", 8192)))
