"""Token embedding and LM head (full vocabulary on each rank for now)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=params_dtype or torch.get_default_dtype()),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"embedding shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection; ``tie_to`` shares the embedding's weight."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
