"""Sequence classification and reward heads over the Llama-family decoder.

``*ForSequenceClassification`` checkpoints (reward models are the ``num_labels == 1`` case) keep
the decoder of the causal LM and replace the LM head by ``score``, a linear layer from the hidden
size to ``num_labels``, read at one position per sequence: the last token that is not the padding
token, as transformers picks it (its batches may be padded on either side, so it takes the
rightmost non-padding token).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.quantization import QuantizationConfig
from engine.model_executor.forward_batch import ForwardBatch
from engine.pooling import PoolingConfig
from engine_models_llama.llama import LlamaForCausalLM


class LlamaForSequenceClassification(LlamaForCausalLM):
    """The decoder of ``LlamaForCausalLM`` (and its checkpoint loading) with a ``score`` head.

    A pooling model (``--task score``): the engine pools ``forward_hidden``'s states at each
    request's last token (``score_pooling``) and maps the pooled state to ``num_labels`` logits
    with ``pooling_head``.
    """

    head_prefixes = ("score.",)

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        # Not the causal LM's constructor: no LM head and no logits processor to build.
        nn.Module.__init__(self)
        self.config = config
        self.model = self.model_cls(config, quant_config)
        self.num_labels = int(config.num_labels)
        # The head stays unquantized: num_labels outputs cost nothing next to the decoder.
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.tie_word_embeddings = False
        pad = getattr(config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else None
        self.pooling_size = self.num_labels
        self.score_pooling = PoolingConfig("last", False, f"{type(self).__name__}: the last non-padding token")

    def pooling_input(self, input_ids: list[int]) -> list[int]:
        """The prompt as scored: without its trailing padding tokens. transformers reads the last
        token that is not padding; under causal attention the states up to it do not depend on
        the padding after it, so last-token pooling of the trimmed prompt reads the same state
        (also when the padding would have come in a chunk of its own or after a cached prefix).
        An all-padding prompt keeps its first token, where transformers reads one.
        """
        if self.pad_token_id is None:
            return input_ids
        end = len(input_ids)
        while end > 1 and input_ids[end - 1] == self.pad_token_id:
            end -= 1
        return input_ids[:end]

    def pooling_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` pooled states -> ``[n, num_labels]`` logits."""
        return self.score(pooled.to(self.score.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> Any:
        raise NotImplementedError(f"{type(self).__name__} scores (--task score); it does not generate")


class MistralForSequenceClassification(LlamaForSequenceClassification):
    pass


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    pass


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    pass


CLASSES: tuple[type[nn.Module], ...] = (LlamaForSequenceClassification, MistralForSequenceClassification,
                                        Qwen2ForSequenceClassification, Qwen3ForSequenceClassification)


def model_class_for(architecture: str) -> type[nn.Module]:
    return {cls.__name__: cls for cls in CLASSES}[architecture]
