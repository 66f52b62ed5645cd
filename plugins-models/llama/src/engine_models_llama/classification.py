"""Sequence classification and reward heads over the Llama-family decoder.

``*ForSequenceClassification`` checkpoints (reward models are the ``num_labels == 1`` case) keep
the decoder of the causal LM and replace the LM head by ``score``, a linear layer from the hidden
size to ``num_labels``, read at one position per sequence: the last token that is not the padding
token, as transformers picks it (its batches may be padded on either side, so it takes the
rightmost non-padding token; a prompt that ends in padding tokens is scored where they start).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.pipeline import PPMissingLayer, PPProxyTensors
from engine.layers.quantization import QuantizationConfig
from engine.model_executor.forward_batch import ForwardBatch
from engine_models_llama.llama import LlamaForCausalLM


def last_non_pad_rows(forward_batch: ForwardBatch, pad_token_id: int | None) -> torch.Tensor:
    """Per row of an EXTEND batch, the index (into the batch's tokens) of its last new token that
    is not ``pad_token_id``; every row's last new token when there is no padding token.

    A row whose new tokens are all padding gets its first new token, as transformers does for an
    all-padding sequence (it takes position 0).
    """
    assert forward_batch.extend_seq_lens is not None and forward_batch.extend_start_loc is not None, (
        "sequence classification runs on prefill (EXTEND) batches only")
    starts = forward_batch.extend_start_loc
    lens = forward_batch.extend_seq_lens
    ends = starts + lens - 1
    if pad_token_id is None:
        return ends
    ids = forward_batch.input_ids
    token_index = torch.arange(ids.shape[0], device=ids.device)
    row_of_token = torch.repeat_interleave(torch.arange(lens.shape[0], device=ids.device), lens)
    candidates = torch.where(ids != pad_token_id, token_index, torch.full_like(token_index, -1))
    last = torch.full_like(ends, -1).scatter_reduce(0, row_of_token, candidates, reduce="amax")
    return torch.where(last >= 0, last, starts)


class LlamaForSequenceClassification(LlamaForCausalLM):
    """The decoder of ``LlamaForCausalLM`` (and its checkpoint loading) with a ``score`` head.

    ``forward`` returns ``[batch_size, num_labels]`` float32 logits, one row per sequence.
    """

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        # Not the causal LM's constructor: no LM head and no logits processor to build.
        nn.Module.__init__(self)
        self.config = config
        self.model = self.model_cls(config, quant_config)
        self.num_labels = int(config.num_labels)
        # The head stays unquantized: num_labels outputs cost nothing next to the decoder.
        self.score = (nn.Linear(config.hidden_size, self.num_labels, bias=False)
                      if self.model.stage.is_last else PPMissingLayer())
        self.tie_word_embeddings = False
        pad = getattr(config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else None

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor | PPProxyTensors:
        hidden = self.model(input_ids, positions, forward_batch)
        if isinstance(hidden, PPProxyTensors):
            return hidden
        rows = hidden[last_non_pad_rows(forward_batch, self.pad_token_id)]
        return self.score(rows).float()


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
