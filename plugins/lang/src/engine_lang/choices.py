"""How ``select`` picks among choices from their token logprobs (SGLang's three methods).

Each method receives, per choice, the logprobs of the choice's tokens given the prompt (and, for
the unconditional method, given nothing) and returns the index of the best choice with the scores
it compared. Scores come from the model's input logprobs of one batched scoring request; nothing
is sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ChoiceLogprobs:
    """A choice's tokens as scored by the backend."""

    # [logprob, token_id, token_text] per token of the choice given the prompt (the first may be
    # a token that straddles the prompt's end: SGLang's token healing).
    tokens: list[list[Any]]
    # Logprobs of the choice's tokens given no prompt (only for methods that ask for them); the
    # first token has none (it starts its own prompt) and counts as 0, as in SGLang.
    unconditional: list[float | None] | None = None

    @property
    def logprobs(self) -> list[float]:
        return [float(t[0]) for t in self.tokens if t[0] is not None]


@dataclass
class ChoiceDecision:
    index: int
    # The method's score per choice (higher is better).
    scores: list[float]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


class ChoicesMethod:
    """Base: a name users pass as ``choices_method`` and the scoring rule."""

    name = ""
    requires_unconditional = False

    def __call__(self, choices: list[ChoiceLogprobs]) -> ChoiceDecision:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ChoicesMethod):
    """The mean logprob of the choice's tokens (SGLang's default)."""

    name = "token_length_normalized"

    def __call__(self, choices: list[ChoiceLogprobs]) -> ChoiceDecision:
        scores = [_mean(c.logprobs) for c in choices]
        return ChoiceDecision(max(range(len(scores)), key=scores.__getitem__), scores)


# Logprobs closer than this count as a tie in greedy_token_selection: the same token after the
# same prefix, scored in different rows of one batch, can differ in the last float bits.
TIE_TOLERANCE = 1e-4


class GreedyTokenSelection(ChoicesMethod):
    """Token by token, keep the choices whose token is most likely (within ``TIE_TOLERANCE``);
    shorter choices are padded with their own mean logprob. Ties after the longest choice go to
    the first."""

    name = "greedy_token_selection"

    def __call__(self, choices: list[ChoiceLogprobs]) -> ChoiceDecision:
        rows = [c.logprobs for c in choices]
        width = max(len(r) for r in rows)
        matrix = [r + [_mean(r)] * (width - len(r)) for r in rows]
        remaining = list(range(len(rows)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] >= best - TIE_TOLERANCE]
            if len(remaining) == 1:
                break
        # The score shown is each choice's first-token logprob: what the first step compared.
        return ChoiceDecision(remaining[0], [m[0] for m in matrix])


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """Mean over the choice's tokens of logprob given the prompt minus logprob given nothing:
    prefers choices the prompt makes likelier, not choices that are likely anyway."""

    name = "unconditional_likelihood_normalized"
    requires_unconditional = True

    def __call__(self, choices: list[ChoiceLogprobs]) -> ChoiceDecision:
        scores = []
        for c in choices:
            if c.unconditional is None:
                raise ValueError(f"{self.name}: the backend returned no unconditional logprobs")
            uncond = [0.0 if v is None else float(v) for v in c.unconditional]
            # The mean of per-token differences when the choice tokenizes alike alone and after
            # the prompt (the usual case); the difference of the two means otherwise.
            scores.append(_mean(c.logprobs) - (_mean(uncond) if uncond else 0.0))
        return ChoiceDecision(max(range(len(scores)), key=scores.__getitem__), scores)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

METHODS: dict[str, ChoicesMethod] = {m.name: m for m in (
    token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)}


def resolve_method(method: ChoicesMethod | str | None) -> ChoicesMethod:
    if method is None:
        return token_length_normalized
    if isinstance(method, ChoicesMethod):
        return method
    if isinstance(method, str) and method in METHODS:
        return METHODS[method]
    raise ValueError(f"choices_method: unknown method {method!r}; accepted: {', '.join(METHODS)} "
                     "(or an engine_lang.choices.ChoicesMethod)")
