"""The attention layer models use: routes to the selected attention backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.model_executor.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """Attention over the paged KV pool; carries what backends need to know of the layer.

    Satisfies ``engine.attention.AttentionLayerInfo``.
    """

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int,
                 layer_id: int, logit_cap: float = 0.0, sliding_window_size: int = -1,
                 v_head_dim: int = -1) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.logit_cap = logit_cap
        self.sliding_window_size = sliding_window_size if sliding_window_size else -1
        self.v_head_dim = v_head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        backend = forward_batch.attn_backend
        assert backend is not None, "ForwardBatch has no attention backend"
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache)
