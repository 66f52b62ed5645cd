"""Proposers with known behaviour, for tests and benchmarks of speculative decoding.

- ``OracleProposer``: the target's own continuation, recorded beforehand: every draft is right
  (greedy), so a verify step keeps all of them. Tests use it to check full acceptance;
  ``engine bench spec --ceiling`` uses it for the mechanism's ceiling (drafts free and right).
- ``RandomProposer``: chains of random length and random tokens (nearly all rejected): the
  output must still equal plain decoding, whatever is drafted.
- ``OracleTreeProposer`` / ``RandomTreeProposer``: the same as ``DraftTree``s.

They draft from nothing but what they are given and a seeded ``random.Random``, so a test that
uses them is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from engine.speculative import DraftRequest, DraftTree, Proposer, TargetHidden

#: Token ids drawn by the random proposers: below every tiny test checkpoint's vocabulary.
DEFAULT_VOCAB = 2048


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation, known in advance: every draft is right.

    Answers are looked up by request id (``expect``) first, then by prompt (the constructor's
    ``prompts``/``outputs`` pairs); a request with neither gets no drafts, which makes its
    decode steps plain. A request whose output has parted from its answer (a half-precision
    near-tie) keeps being offered the answer's tokens: they are then rejected.
    """

    def __init__(self, prompts: Sequence[Sequence[int]] = (), outputs: Sequence[Sequence[int]] = ()) -> None:
        if len(prompts) != len(outputs):
            raise ValueError(f"OracleProposer: {len(prompts)} prompts but {len(outputs)} outputs; "
                             "expected one output per prompt")
        self.by_prompt: dict[tuple[int, ...], list[int]] = {tuple(p): list(o) for p, o in zip(prompts, outputs, strict=True)}
        self.by_rid: dict[str, list[int]] = {}

    def expect(self, rid: str, output: Sequence[int]) -> None:
        """Request ``rid`` will generate ``output`` (wins over an answer for its prompt)."""
        self.by_rid[rid] = list(output)

    def forget(self) -> None:
        """Drops every answer: from now on nothing is proposed (plain decode steps)."""
        self.by_prompt.clear()
        self.by_rid.clear()

    def answer(self, req: DraftRequest) -> list[int]:
        found = self.by_rid.get(req.rid)
        return found if found is not None else self.by_prompt.get(tuple(req.prompt_ids), [])

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
        out: list[list[int] | DraftTree] = []
        for r in reqs:
            done = len(r.output_ids)
            out.append(self.answer(r)[done: done + r.max_draft])
        return out


class RandomProposer(Proposer):
    """Drafts of random length (0..max) and random tokens below ``vocab``: rows padded by
    different amounts, nearly every draft rejected."""

    def __init__(self, seed: int = 0, vocab: int = DEFAULT_VOCAB) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
        return [[self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, r.max_draft))] for r in reqs]


class OracleTreeProposer(Proposer):
    """A tree per request: the target's greedy continuation on one branch (depth ``depth``), a
    longer branch of random tokens (so the longest-chain fall-back picks a decoy), random side
    branches off the right path; branches at the root in random order. Keeps the target's
    hidden states it is handed (``hidden``)."""

    def __init__(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], depth: int,
                 seed: int = 0, vocab: int = DEFAULT_VOCAB) -> None:
        self.answers = {tuple(p): list(o) for p, o in zip(prompts, outputs, strict=True)}
        self.depth = depth
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.hidden: list[TargetHidden] = []

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
        out: list[list[int] | DraftTree] = []
        for r in reqs:
            answer = self.answers[tuple(r.prompt_ids)]
            right = list(answer[len(r.output_ids): len(r.output_ids) + min(self.depth, r.max_draft)])
            decoy = [self.rng.randrange(self.vocab) for _ in range(min(len(right) + 1, r.max_draft - len(right)))]
            branches = [right, decoy]
            self.rng.shuffle(branches)
            tokens: list[int] = []
            parents: list[int] = []
            right_nodes: list[int] = []
            for branch in branches:
                for j, t in enumerate(branch):
                    parents.append(-1 if j == 0 else len(tokens) - 1)
                    if branch is right:
                        right_nodes.append(len(tokens))
                    tokens.append(t)
            # Side branches: a random token hanging off a random node of the right path.
            while len(tokens) < r.max_draft and right_nodes:
                parents.append(self.rng.choice([-1, *right_nodes]))
                tokens.append(self.rng.randrange(self.vocab))
            out.append(DraftTree(tokens, parents))
        return out

    def on_target_hidden(self, states: Sequence[TargetHidden]) -> None:
        self.hidden.extend(states)


class RandomTreeProposer(Proposer):
    """Random trees: random size (0..max), random tokens, each node's parent any earlier node."""

    def __init__(self, seed: int = 0, vocab: int = DEFAULT_VOCAB) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
        out: list[list[int] | DraftTree] = []
        for r in reqs:
            n = self.rng.randint(0, r.max_draft)
            out.append(DraftTree([self.rng.randrange(self.vocab) for _ in range(n)],
                                 [self.rng.randrange(-1, i) for i in range(n)]))
        return out


__all__ = ["DEFAULT_VOCAB", "OracleProposer", "OracleTreeProposer", "RandomProposer", "RandomTreeProposer"]
