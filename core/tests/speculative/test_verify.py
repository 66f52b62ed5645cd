"""Chain and tree verification on hand-made logits: greedy acceptance and the rejection samplers' law."""

from __future__ import annotations

import torch

from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.speculative.verify import verify_chain, verify_tree
from engine.testing.harness import sampling_info


def _info(n: int, vocab: int, **params: object) -> SamplingBatchInfo:
    return sampling_info([params] * n, vocab)


def _one_hot_logits(ids: list[int], vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(ids), vocab)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return logits


def test_greedy_keeps_longest_agreeing_prefix_plus_target_token() -> None:
    vocab = 16
    # Row 0: target argmax 3, 4, 5 at its positions; drafts [3, 9]: keeps 3, then the target's 4.
    # Row 1: drafts [7] all agree: keeps 7, then the bonus token 8.
    # Row 2: no drafts: one token, the argmax.
    logits = _one_hot_logits([3, 4, 5, 7, 8, 2], vocab)
    out = verify_chain(logits, [[3, 9], [7], []], _info(3, vocab, temperature=0.0))
    assert out == [[3, 4], [7, 8], [2]]


def test_greedy_rejects_first_draft() -> None:
    logits = _one_hot_logits([1, 2, 3], 8)
    assert verify_chain(logits, [[5, 2]], _info(1, 8, temperature=0.0)) == [[1]]


def test_logit_bias_applies_at_every_position() -> None:
    logits = _one_hot_logits([1, 1, 1], 8)
    out = verify_chain(logits, [[6, 6]], _info(1, 8, temperature=0.0, logit_bias={"6": 100.0}))
    assert out == [[6, 6, 6]]


def test_rejection_sampling_matches_target_distribution() -> None:
    """Chi-square test of the first emitted token: target p over a 6-token vocabulary (with
    top-k 5 cutting the last), a fixed wrong-ish draft. 20,000 draws; the statistic with 4
    degrees of freedom exceeds 18.47 with probability 0.001, so a correct sampler fails this
    test about once in a thousand seeds (the seed is fixed: it is deterministic here)."""
    torch.manual_seed(0)
    vocab, n = 6, 20000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    info = _info(n, vocab, temperature=0.8, top_k=5)
    logits = base.repeat(2 * n, 1)
    out = verify_chain(logits, [[1]] * n, info)
    first = torch.tensor([o[0] for o in out])
    counts = torch.bincount(first, minlength=vocab).double()
    p = torch.softmax(base / 0.8, dim=-1)
    p[5] = 0.0
    p = p / p.sum()
    assert counts[5] == 0, "top-k cut token sampled"
    expected = p[:5] * n
    chi2 = float(((counts[:5] - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, (chi2, counts.tolist(), expected.tolist())
    # The draft is kept with probability p(1): about that share of rows emit two tokens.
    kept = sum(len(o) == 2 for o in out) / n
    assert abs(kept - float(p[1])) < 0.02


def test_second_token_after_acceptance_follows_its_position() -> None:
    """After a kept draft the next token comes from the next position's distribution."""
    torch.manual_seed(1)
    n, vocab = 4000, 4
    first = torch.tensor([0.0, 10.0, 0.0, 0.0])  # draft 1 is almost surely kept
    second = torch.tensor([0.0, 0.0, 1.0, 0.0])
    logits = torch.stack([first, second]).repeat(n, 1)
    out = verify_chain(logits, [[1]] * n, _info(n, vocab, temperature=1.0))
    seconds = torch.tensor([o[1] for o in out if len(o) == 2])
    share = float((seconds == 2).double().mean())
    p2 = float(torch.softmax(second, -1)[2])
    assert abs(share - p2) < 0.03, (share, p2)


def test_tree_greedy_walks_the_agreeing_branch() -> None:
    """Row 0: root argmax 5; children 4 (wrong) and 5 (right, node 2), node 2's children 9
    (right, node 3) then 9 again; node 3's argmax 1 is the bonus. Row 1: no child agrees."""
    vocab = 16
    # Row 0 nodes: 0 root, 1 tok 4, 2 tok 5, 3 tok 9 (parent 2), 4 tok 9 (parent 2).
    logits = _one_hot_logits([5, 0, 9, 1, 2, 7, 3, 3], vocab)
    rows = [([0, 4, 5, 9, 9], [-1, 0, 0, 2, 2]), ([0, 6, 8], [-1, 0, 0])]
    out = verify_tree(logits, rows, _info(2, vocab, temperature=0.0))
    assert out == [([0, 2, 3], 1), ([0], 7)]


def test_tree_of_a_chain_equals_chain_verification() -> None:
    logits = _one_hot_logits([3, 4, 5, 7, 8, 2], 16)
    out = verify_tree(logits, [([0, 3, 9], [-1, 0, 1]), ([0, 7], [-1, 0]), ([0], [-1])],
                      _info(3, 16, temperature=0.0))
    assert [[row[j] for j in path[1:]] + [tok] for row, (path, tok) in
            zip([[0, 3, 9], [0, 7], [0]], out)] == verify_chain(logits, [[3, 9], [7], []],
                                                                  _info(3, 16, temperature=0.0))


def test_tree_rejection_sampling_matches_target_distribution() -> None:
    """Chi-square test of the first emitted token with two (and three, one repeated) children
    at the root: 20,000 draws over 6 tokens with top-k 5; 4 degrees of freedom, 0.999 quantile
    18.47. The first child is kept with probability p(c1), the second with p(c2)."""
    torch.manual_seed(2)
    vocab, n = 6, 20000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    p = torch.softmax(base / 0.8, dim=-1)
    p[5] = 0.0
    p = p / p.sum()
    for tokens, parents in (([0, 1, 0], [-1, 0, 0]), ([0, 2, 2, 1], [-1, 0, 0, 0])):
        info = _info(n, vocab, temperature=0.8, top_k=5)
        logits = base.repeat(len(tokens) * n, 1)
        out = verify_tree(logits, [(tokens, parents)] * n, info)
        first = torch.tensor([tokens[path[1]] if len(path) > 1 else tok for path, tok in out])
        counts = torch.bincount(first, minlength=vocab).double()
        assert counts[5] == 0, "top-k cut token sampled"
        expected = p[:5] * n
        chi2 = float(((counts[:5] - expected) ** 2 / expected).sum())
        assert chi2 < 18.47, (tokens, chi2, counts.tolist(), expected.tolist())
        kept_first = sum(len(path) > 1 and path[1] == 1 for path, _ in out) / n
        assert abs(kept_first - float(p[tokens[1]])) < 0.02
        if tokens[2] != tokens[1]:
            kept_second = sum(len(path) > 1 and path[1] == 2 for path, _ in out) / n
            assert abs(kept_second - float(p[tokens[2]])) < 0.02
        else:
            assert all(len(path) == 1 or path[1] != 2 for path, _ in out), "a rejected token accepted again"
