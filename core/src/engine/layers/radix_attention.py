"""The attention layer models use: routes to the selected attention backend."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.model_executor.forward_batch import ForwardBatch

# Checkpoint names of per-tensor KV-cache scales (llm-compressor / compressed-tensors, vLLM's own
# saved layout, AutoFP8's output scales of k_proj/v_proj, ModelOpt), by suffix after the attention
# module's prefix: suffix -> which scale.
_KV_SCALE_SUFFIXES = (
    (".k_scale", "k"), (".v_scale", "v"),
    (".attn.k_scale", "k"), (".attn.v_scale", "v"),
    (".k_proj.output_scale", "k"), (".v_proj.output_scale", "v"),
    (".k_proj.k_scale", "k"), (".v_proj.v_scale", "v"),
)


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """Where a checkpoint's KV-cache scale goes: ``(attention module prefix, "k" | "v")``.

    ``model.layers.3.self_attn.k_scale`` and ``model.layers.3.self_attn.k_proj.output_scale``
    both give ``("model.layers.3.self_attn", "k")``; any other name gives None. A model plugin
    hands the tensor to its ``RadixAttention.load_kv_scale`` under that prefix; whether the
    scale is used depends on ``--kv-cache-dtype``, which the model need not know.
    """
    # Longest suffixes first, so ".attn.k_scale" is not read as ".k_scale" of an "attn" module.
    for suffix, kind in sorted(_KV_SCALE_SUFFIXES, key=lambda s: -len(s[0])):
        if name.endswith(suffix):
            return name[: -len(suffix)], kind
    return None


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
        # Per-tensor scales of an fp8 KV cache (stored = x / scale). Python floats, not tensors:
        # kernels take them as scalars, so a step neither reads them back from the device nor
        # breaks CUDA-graph capture. Unused when the pool stores the activation dtype.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def load_kv_scale(self, kind: str, value: torch.Tensor) -> None:
        """Sets ``k_scale`` (``kind="k"``) or ``v_scale`` from a checkpoint's one-element tensor."""
        if kind not in ("k", "v"):
            raise ValueError(f"load_kv_scale: kind {kind!r}; accepted: 'k', 'v'")
        if value.numel() != 1:
            raise ModelLoadError(f"layer {self.layer_id}: {kind}_scale has shape {tuple(value.shape)}; accepted: "
                                 "one per-tensor scale (per-head or per-channel KV scales are not supported)")
        scale = float(value.detach().float().reshape(()).cpu())
        if not math.isfinite(scale) or scale <= 0:
            raise ModelLoadError(f"layer {self.layer_id}: {kind}_scale is {scale}; accepted: a finite number > 0")
        setattr(self, f"{kind}_scale", scale)

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, k_scale={self.k_scale:g}, v_scale={self.v_scale:g}"

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        backend = forward_batch.attn_backend
        assert backend is not None, "ForwardBatch has no attention backend"
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache)
