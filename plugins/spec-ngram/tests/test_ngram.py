from __future__ import annotations

import numpy as np

from engine.speculative import DraftRequest
from engine.testing import SpeculativeProposerConformance
from engine_spec_ngram.proposer import NgramProposer, lookup_draft


class TestNgram(SpeculativeProposerConformance):
    algorithm_name = "ngram"
    server_args = {"speculative_num_steps": 6}


def test_lookup_continues_latest_match() -> None:
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    # The suffix [1, 2, 3] last occurred at 4 (before the suffix itself): 7, 8 followed it.
    assert lookup_draft(tokens, 2, 3, 1) == [7, 8]
    assert lookup_draft(tokens, 0, 3, 1) == []


def test_falls_back_to_shorter_ngrams_then_nothing() -> None:
    assert lookup_draft(np.array([5, 6, 4, 6]), 3, 3, 1) == [4, 6]  # only the 1-gram [6] matches
    assert lookup_draft(np.array([1, 2, 3]), 3, 3, 1) == []
    assert lookup_draft(np.array([5, 6, 4, 6]), 3, 3, 2) == []  # min_ngram 2: no 2-gram match


def test_proposer_searches_prompt_and_output() -> None:
    proposer = NgramProposer(max_ngram=2)
    req = DraftRequest("a", prompt_ids=[10, 11, 12, 13, 14], output_ids=[11, 12], max_draft=3)
    assert proposer.propose([req]) == [[13, 14, 11]]
