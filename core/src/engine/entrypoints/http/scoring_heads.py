"""What a scoring model's logits mean: its labels and the activation of its relevance score.

Read once per server from the checkpoint's config.json: ``id2label`` names the classes
(transformers' ``LABEL_<i>`` where it names none), and sentence-transformers' ``CrossEncoder``
records the activation it applies to a cross-encoder's logit (``sentence_transformers.activation_fn``,
older checkpoints ``sbert_ce_default_activation_function``). Without one, a single logit goes
through the sigmoid, as ``CrossEncoder`` and vLLM do, so relevance scores lie in (0, 1).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.http.errors import APIError


def _sigmoid(x: float) -> float:
    # The two branches keep exp() from overflowing for logits of large magnitude.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


# The activations sentence-transformers records, by the last part of their class path.
_ACTIVATIONS: dict[str, Callable[[float], float]] = {"Sigmoid": _sigmoid, "Identity": lambda x: x, "Tanh": math.tanh}


@dataclass(frozen=True)
class ScoreHead:
    num_labels: int
    # Class names by index.
    labels: tuple[str, ...]
    # The class path of the score activation ("torch.nn.modules.activation.Sigmoid").
    activation: str

    def activate(self, logit: float) -> float:
        """The relevance score of a one-logit model's output."""
        name = self.activation.rsplit(".", 1)[-1]
        fn = _ACTIVATIONS.get(name)
        if fn is None:
            raise APIError(500, f"the checkpoint's config.json names the score activation {self.activation!r}; "
                                f"supported: {', '.join(_ACTIVATIONS)}", code="model_not_supported")
        return float(fn(logit))

    def probabilities(self, logits: list[float]) -> list[float]:
        """Class probabilities: softmax over the classes, the sigmoid of a single logit."""
        if len(logits) == 1:
            return [_sigmoid(logits[0])]
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        return [e / total for e in exps]


_HEADS: dict[tuple[str, int], ScoreHead] = {}


def score_head(ctx: Any) -> ScoreHead:
    """The head of the model ``ctx`` serves (``ctx.ready.embedding_size`` logits)."""
    num_labels = int(ctx.ready.embedding_size)
    key = (ctx.model_path, num_labels)
    head = _HEADS.get(key)
    if head is None:
        head = _HEADS[key] = read_score_head(ctx.model_path, num_labels)
    return head


def read_score_head(model_path: str, num_labels: int) -> ScoreHead:
    config: dict[str, Any] = {}
    path = os.path.join(model_path, "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    names = config.get("id2label") or {}
    labels = tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(num_labels))
    st = config.get("sentence_transformers") or {}
    activation = (st.get("activation_fn") if isinstance(st, dict) else None) \
        or config.get("sbert_ce_default_activation_function") or "torch.nn.modules.activation.Sigmoid"
    return ScoreHead(num_labels, labels, str(activation))
