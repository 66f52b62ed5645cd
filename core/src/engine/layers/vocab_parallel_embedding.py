"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks.

The vocabulary is padded up to a multiple of the tensor-parallel size, so any size that
divides the attention heads works whatever the vocabulary: rank ``r`` holds rows
``[r * per_rank, (r + 1) * per_rank)``; padding rows are zero, embed nothing anyone asks for,
and their logits are cut off after the gather (``LogitsProcessor``). At size 1 the layer is a
plain embedding of exactly ``num_embeddings`` rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from engine.layers.linear import set_weight_attrs

if TYPE_CHECKING:
    from collections.abc import Callable


def padded_vocab_size(num_embeddings: int, tp_size: int) -> int:
    """``num_embeddings`` rounded up to a multiple of ``tp_size``."""
    return -(-num_embeddings // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings_padded = padded_vocab_size(num_embeddings, self.tp_size)
        self.rows_per_rank = self.num_embeddings_padded // self.tp_size
        # This rank's rows of the (padded) vocabulary.
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, embedding_dim, dtype=params_dtype or torch.get_default_dtype()),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding shape mismatch: parameter {(self.num_embeddings, param.shape[1])}, "
                             f"checkpoint {tuple(loaded.shape)}")
        rows = loaded[self.vocab_start:min(self.vocab_end, self.num_embeddings)]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids owned by another rank look up row 0 here and are zeroed; the sum over ranks
        # leaves each token exactly its owner's row.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection; ``tie_to`` shares the embedding's weight (the same rows per rank).

    The projection itself is ``LogitsProcessor``'s: each rank computes its rows' logits and
    they are gathered over the tensor-parallel group.
    """

    #: the quantization method's own ``h @ weight.T`` for this head
    #: (``QuantizationConfig.get_lm_head_projection``, set after loading); None: ``F.linear``.
    projection: Callable[[torch.Tensor], torch.Tensor] | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
