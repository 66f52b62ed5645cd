"""Rotary position embeddings (neox style), with the common rope scalings, and the multimodal
rotary (M-RoPE) of Qwen2-VL."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters(config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from a HF config of transformers 4.x or 5.x."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = dict(getattr(config, "rope_scaling", None) or params or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None)) or 10000.0
    return float(theta), scaling


def _inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type '{kind}'; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k given token positions."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        inv = _inv_freq(rotary_dim, base, scaling or {})
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        # float32 cache; cast per call to the activation dtype, as HF does.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)
        self.fused: Any = None
        self.fused_qk: Any = None
        #: layers whose rotary embeddings have equal keys share one cos/sin per forward.
        self.key = (head_dim, rotary_dim, max_position, base, repr(sorted((scaling or {}).items())))

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's in-place kernels when it offers them: ``rotary_qk_inplace``
        (q and k in one launch), else ``rotary_inplace`` (one tensor per launch)."""
        self.fused = kernels.get("rotary_inplace")
        self.fused_qk = kernels.get("rotary_qk_inplace")

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: ``[T, heads*head_dim]``, k: ``[T, kv_heads*head_dim]``; returns rotated q and k
        (new tensors, or q and k themselves rotated in place by a fused kernel)."""
        if (self.fused or self.fused_qk) is not None and q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
            if self.fused_qk is not None:
                self.fused_qk(positions, q, k, self.cos_cache, self.sin_cache, self.head_dim, self.rotary_dim)
            else:
                self.fused(positions, q, self.cos_cache, self.sin_cache, self.head_dim, self.rotary_dim)
                self.fused(positions, k, self.cos_cache, self.sin_cache, self.head_dim, self.rotary_dim)
            return q, k
        cos = self.cos_cache[positions].to(q.dtype)
        sin = self.sin_cache[positions].to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate_joint(self, positions: torch.Tensor, qk: torch.Tensor,
                     shared: dict[Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]]) -> torch.Tensor:
        """q and k rotated in one pass: ``qk`` ``[T, (heads + kv_heads) * head_dim]`` (the two
        side by side, e.g. a view of the fused q/k/v output) -> a new tensor of that shape.

        The same float operations as ``forward`` on each (elementwise, so the same values), with
        a fifth of its operator calls: the cos/sin at ``positions`` come from ``shared`` (one
        forward's dict, ``ForwardBatch.rope_cos_sin``) once the first layer has put them there.
        """
        entry = shared.get(self.key)
        # Read anew by the layer that wrote them: it runs first in every forward, and a static
        # batch (graph runners) rewrites the same positions tensor in place between steps.
        if entry is None or entry[0] is not positions or entry[3] is self:
            cos = self.cos_cache[positions].to(qk.dtype)
            sin = self.sin_cache[positions].to(qk.dtype)
            entry = (positions, torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :],
                     self)
            shared[self.key] = entry
        t = qk.shape[0]
        x = qk.view(t, -1, self.head_dim)
        rot = x[..., : self.rotary_dim]
        half = self.rotary_dim // 2
        rotated = rot * entry[1] + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * entry[2]
        if self.rotary_dim < self.head_dim:
            rotated = torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)
        return rotated.reshape(t, -1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, self.head_dim)
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        c = torch.cat((cos, cos), dim=-1)[:, None, :]
        s = torch.cat((sin, sin), dim=-1)[:, None, :]
        rotated = rot * c + torch.cat((-x2, x1), dim=-1) * s
        out = torch.cat((rotated, passthrough), dim=-1) if passthrough.numel() else rotated
        return out.reshape(t, -1)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding (Qwen2-VL's M-RoPE): each token has three positions (temporal,
    height, width), and the rotated pairs split into three consecutive sections of
    ``mrope_section`` pairs, the first turning with the temporal position, the second with the
    height, the third with the width.

    ``forward`` takes positions ``[3, T]``, or ``[T]`` where the three are equal (text tokens, and
    every decode token): then it rotates exactly as ``RotaryEmbedding`` does.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None, mrope_section: list[int]) -> None:
        if len(mrope_section) != 3 or sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"mrope_section: invalid value {list(mrope_section)}; accepted: three section sizes "
                             f"(temporal, height, width) adding up to half the rotary dimension ({rotary_dim // 2})")
        scaling = dict(scaling or {})
        # Older configs name the multimodal rotary "mrope": its frequencies are the default ones.
        if scaling.get("rope_type", scaling.get("type")) == "mrope":
            scaling.pop("type", None)
            scaling["rope_type"] = "default"
        super().__init__(head_dim, rotary_dim, max_position, base, scaling)
        self.mrope_section = [int(n) for n in mrope_section]
        self.key = (*self.key, "mrope", tuple(self.mrope_section))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        cos = self._by_section(self.cos_cache[positions]).to(q.dtype)
        sin = self._by_section(self.sin_cache[positions]).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _by_section(self, table: torch.Tensor) -> torch.Tensor:
        """``[3, T, rotary_dim / 2]`` (each token's angles at its three positions) ->
        ``[T, rotary_dim / 2]``: section ``i`` of the pairs taken from position row ``i``."""
        return torch.cat([part[i] for i, part in enumerate(table.split(self.mrope_section, dim=-1))], dim=-1)


def get_rope(head_dim: int, max_position: int, config: Any, rotary_dim: int | None = None) -> RotaryEmbedding:
    theta, scaling = rope_parameters(config)
    return RotaryEmbedding(head_dim, rotary_dim or head_dim, max_position, theta, scaling)
