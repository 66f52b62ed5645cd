"""The Qwen2-VL and Qwen2.5-VL vision transformers, with Hugging Face's parameter names.

An image (or a video) arrives as the processor's flattened patches, ``[patches, C * T * P * P]``
(``T`` frames of ``P x P`` pixels per patch), and its grid ``(t, h, w)`` in patches. The tower
embeds the patches, runs bidirectional blocks with a 2D rotary embedding over each patch's
``(row, column)``, and merges every ``m x m`` block of patches into one token of the language
model's width. Attention never crosses a frame (Qwen2-VL) or, in Qwen2.5-VL's windowed blocks, a
window of ``window_size`` pixels; all images of a batch run in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.layernorm import RMSNorm

Grid = Sequence[tuple[int, int, int]]

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def _activation(name: str) -> Any:
    act = _ACTIVATIONS.get(name)
    if act is None:
        raise ModelLoadError(f"vision_config.hidden_act: unsupported value '{name}'; supported: {', '.join(_ACTIVATIONS)}")
    return act


def patch_positions(grid: Grid, merge: int) -> torch.Tensor:
    """``[patches, 2]`` (row, column) of every patch in the processor's order: frame by frame,
    and within a frame ``merge x merge`` blocks in raster order, each block's patches in raster order."""
    out = []
    for t, h, w in grid:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        hw = torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


def window_order(grid: Grid, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the order of the merged tokens that puts each window's tokens side by
    side (``[merged tokens]``, a permutation), and the windows' lengths in patches.

    A window covers ``window x window`` merged tokens of one frame (``window_size // merge //
    patch_size``); windows at the right and bottom edges are smaller.
    """
    order, lengths, base = [], [], 0
    for t, h, w in grid:
        gh, gw = h // merge, w // merge
        # One frame's windows, laid out once: pad the merged grid to whole windows with -1, read it
        # window by window, drop the padding; every frame of the item repeats it at its own offset.
        ph, pw = -gh % window, -gw % window
        padded = F.pad(torch.arange(gh * gw).view(gh, gw), (0, pw, 0, ph), value=-1)
        windows = padded.view((gh + ph) // window, window, (gw + pw) // window, window).transpose(1, 2)
        windows = windows.reshape(-1, window * window)
        frame = windows[windows >= 0]
        sizes = ((windows >= 0).sum(1) * merge * merge).tolist()
        order.append((torch.arange(t)[:, None] * (gh * gw) + frame).reshape(-1) + base)
        lengths += sizes * t
        base += t * gh * gw
    return torch.cat(order), lengths


class Segments:
    """Consecutive segments of a packed sequence, grouped by length for batched attention: one
    group per distinct length (the frames of images of one size, the full windows of a grid),
    with the token indices of its segments. Built once per forward, on the host, and shared by
    the blocks that attend within the same segments."""

    def __init__(self, lengths: Sequence[int], device: torch.device) -> None:
        starts, at = {}, 0
        for n in lengths:
            starts.setdefault(n, []).append(at)
            at += n
        #: (segments, length, token indices [segments * length]) per distinct length.
        self.groups = [(len(first), n, (torch.tensor(first)[:, None] + torch.arange(n)).reshape(-1).to(device))
                       for n, first in starts.items()]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment: ``q``, ``k``, ``v`` ``[tokens, heads,
    head_dim]``. Segments of one length run as one batched call; no token attends across a
    segment boundary and no padding is computed."""
    out = torch.empty_like(q)
    for count, size, index in segments.groups:
        # [segments, heads, size, head_dim]
        qs, ks, vs = (x[index].view(count, size, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[index] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation over the whole head, in float32 (as the reference computes it)."""
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = segment_attention(q, k, v, segments, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: ``fc2(act(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL: ``down(act(gate(x)) * up(x))``, every projection with a bias."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, rms_norm: bool) -> None:
        super().__init__()
        self.norm1: nn.Module = RMSNorm(dim, 1e-6) if rms_norm else nn.LayerNorm(dim, eps=1e-6)
        self.norm2: nn.Module = RMSNorm(dim, 1e-6) if rms_norm else nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norms each patch, concatenates the ``merge x merge`` patches of a block and projects them to
    the language model's width with a GELU MLP."""

    def __init__(self, out_dim: int, dim: int, merge: int, rms_norm: bool) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q: nn.Module = RMSNorm(dim, 1e-6) if rms_norm else nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchEmbed(nn.Module):
    """The reference's Conv3d with stride equal to its kernel, over inputs of exactly one kernel:
    a matrix product with the flattened kernel (the same sums, one GEMM)."""

    def __init__(self, channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv3d(channels, dim, kernel_size=(temporal, patch, patch),
                              stride=(temporal, patch, patch), bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1))


class VisionTransformer(nn.Module):
    """Qwen2-VL's tower (``windowed=False``: LayerNorm, fc MLP, attention within frames) or
    Qwen2.5-VL's (``windowed=True``: RMSNorm, gated MLP, window attention except in
    ``fullatt_block_indexes``)."""

    def __init__(self, config: Any, windowed: bool) -> None:
        super().__init__()
        self.windowed = windowed
        self.merge = int(config.spatial_merge_size)
        self.patch_size = int(config.patch_size)
        heads = int(config.num_heads)
        if windowed:
            dim, out_dim = int(config.hidden_size), int(config.out_hidden_size)
            self.full_blocks = set(config.fullatt_block_indexes)
            self.window = int(config.window_size) // self.merge // self.patch_size
            if self.window < 1:
                raise ModelLoadError(f"vision_config.window_size: invalid value {config.window_size}; accepted: at "
                                     f"least spatial_merge_size * patch_size ({self.merge * self.patch_size})")
        else:
            dim, out_dim = int(config.embed_dim), int(config.hidden_size)
        if dim % heads or (dim // heads) % 4:
            raise ModelLoadError(f"vision_config: width {dim} over {heads} heads must give a head size divisible by 4")
        self.patch_embed = PatchEmbed(int(config.in_channels), int(config.temporal_patch_size), self.patch_size, dim)
        head_dim = dim // heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / theta**quarter, persistent=False)

        def mlp() -> nn.Module:
            if windowed:
                return GatedVisionMLP(dim, int(config.intermediate_size), config.hidden_act)
            return VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act)

        self.blocks = nn.ModuleList(VisionBlock(dim, heads, mlp(), windowed) for _ in range(int(config.depth)))
        self.merger = PatchMerger(out_dim, dim, self.merge, windowed)

    def rotary(self, grid: Grid, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[patches, 1, head_dim]``: the first half of each rotated pair turns with the
        patch's row, the second with its column."""
        pos = patch_positions(grid, self.merge).to(device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [patches, head_dim / 2]
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, grid: Grid) -> torch.Tensor:
        """``pixels`` ``[patches, C*T*P*P]`` of every image and video of the batch, in ``grid``'s
        order -> ``[patches / merge^2, out_dim]`` merged tokens in the same order."""
        x = self.patch_embed(pixels)
        cos, sin = self.rotary(grid, x.device)
        frames = Segments([h * w for t, h, w in grid for _ in range(t)], x.device)
        if not self.windowed:
            for block in self.blocks:
                x = block(x, cos, sin, frames)
            return self.merger(x)
        unit = self.merge * self.merge
        order, window_lengths = window_order(grid, self.merge, self.window)
        order, windows = order.to(x.device), Segments(window_lengths, x.device)

        def by_window(t: torch.Tensor) -> torch.Tensor:  # merged-token order -> window order, per patch
            return t.view(-1, unit, *t.shape[1:])[order].flatten(0, 1)

        x, cos, sin = by_window(x), by_window(cos), by_window(sin)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_blocks else windows)
        merged = self.merger(x)
        return merged[torch.argsort(order)]
