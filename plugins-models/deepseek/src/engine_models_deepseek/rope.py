"""DeepSeek's rotary embedding of the decoupled rope dims: YaRN scaling and the interleaved layout.

DeepSeek checkpoints rotate pairs of adjacent dims ``(x0, x1), (x2, x3), ...`` (V2 always; V3
when ``rope_interleave``, its default); the rotation here de-interleaves them first and returns
the neox (half-split) layout. Queries and keys go through the same permutation, so their dot
products, the only thing attention reads, are those of the checkpoint's layout.

YaRN (``rope_parameters.rope_type == "yarn"``) follows transformers: inverse frequencies blended
between interpolation and extrapolation over the correction range of ``beta_fast``/``beta_slow``,
and cos/sin multiplied by the attention factor (``mscale / mscale_all_dim``'s ratio, 1.0 for
DeepSeek's own configs). The softmax-scale part of YaRN (``mscale_all_dim``) is
``softmax_scale``'s.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from engine.layers.rotary_embedding import rope_parameters


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_type(scaling: dict[str, Any]) -> str:
    return str(scaling.get("rope_type", scaling.get("type", "default")) or "default")


def softmax_scale(config: Any) -> float:
    """DeepSeek's attention scale: ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times
    ``yarn_mscale(factor, mscale_all_dim)**2`` under a rope scaling that sets ``mscale_all_dim``."""
    scale = float(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = rope_parameters(config)
    if _rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
                            if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention_factor)


# The cos/sin tables of one configuration, shared by every layer's rotary module (V3's 163,840
# positions make a table pair of 42 MB; one per layer would be 2.5 GB): weak, so they go with the model.
_TABLES: weakref.WeakValueDictionary[tuple[Any, ...], torch.Tensor] = weakref.WeakValueDictionary()


def _tables(key: tuple[Any, ...], inv: torch.Tensor, max_position: int,
            attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    device = torch.empty(0).device  # the device the model is being built on
    cos, sin = _TABLES.get((*key, "cos", device)), _TABLES.get((*key, "sin", device))
    if cos is None or sin is None:
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv.to(device))
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        _TABLES[(*key, "cos", device)], _TABLES[(*key, "sin", device)] = cos, sin
    return cos, sin


class DeepseekRotaryEmbedding(nn.Module):
    """Rotates the rope dims of q ``[T, H, d]`` and k ``[T, 1, d]`` at ``positions``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = int(config.qk_rope_head_dim)
        base, scaling = rope_parameters(config)
        max_position = int(config.max_position_embeddings)
        kind = _rope_type(scaling)
        if kind == "yarn":
            inv, attention_factor = _yarn_inv_freq(dim, base, scaling, max_position)
        elif kind == "default":
            inv, attention_factor = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
        else:
            raise ValueError(f"DeepSeek rope_parameters.rope_type: invalid value {kind!r}; accepted: default, yarn")
        # V2's transformers class has no rope_interleave switch: its complex rotation always pairs
        # adjacent dims.
        self.interleave = bool(getattr(config, "rope_interleave", True))
        key = (dim, base, repr(sorted(scaling.items())), max_position)
        cos, sin = _tables(key, inv, max_position, attention_factor)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        # float32 like transformers' V2 (its complex product); exact for V3's float32 tests.
        x1, x2 = x1.float(), x2.float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
