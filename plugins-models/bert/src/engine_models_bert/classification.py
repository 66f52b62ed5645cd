"""BERT cross-encoders and classifiers: ``BertForSequenceClassification`` (``--task score``).

transformers' head: BertModel's pooler (tanh of a dense layer over the ``[CLS]`` state), dropout
(nothing at inference) and ``classifier``, a linear layer to ``num_labels``. A cross-encoder
reranker (sentence-transformers' ms-marco MiniLM models) is the ``num_labels == 1`` case, fed the query and
the document as one text pair with segment ids 0 and 1 (``token_type_ids``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.pooling import PoolingConfig
from engine_models_bert.bert import BertModel


class BertForSequenceClassification(BertModel):
    """The encoder of ``BertModel``; the engine pools each row's first (``[CLS]``) state and maps
    it to ``num_labels`` logits with ``pooling_head``."""

    def __init__(self, config: Any, quant_config: Any = None, options: dict[str, Any] | None = None) -> None:
        super().__init__(config, quant_config, options)
        self.num_labels = int(config.num_labels)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)
        self.pooling_size = self.num_labels
        self.score_pooling = PoolingConfig("cls", False, "BertForSequenceClassification: pooler and classifier "
                                                         "over [CLS]")

    def pooling_head(self, cls_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` first-token states -> ``[n, num_labels]`` logits."""
        weight = self.classifier.weight
        return self.classifier(self.pooled_output(cls_states.to(weight.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        if not self.has_pooler:
            raise ModelLoadError("this BertForSequenceClassification checkpoint has no pooler weights "
                                 "(bert.pooler.dense), which its classifier reads")


def model_class_for(architecture: str) -> type[nn.Module]:
    if architecture != "BertForSequenceClassification":
        raise KeyError(architecture)
    return BertForSequenceClassification
