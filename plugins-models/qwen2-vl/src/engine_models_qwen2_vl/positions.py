"""M-RoPE positions of a prompt with images and videos (Qwen2-VL's ``get_rope_index``).

Text tokens count up by one in all three sections. The merged tokens of an item of grid
``(t, h, w)`` (after the ``m x m`` merge) start where the text before it stopped, ``p``: frame
``f``, row ``r``, column ``c`` sits at ``(p + f * interval, p + r, p + c)``, where ``interval`` is
1, or for a Qwen2.5-VL video ``tokens_per_second * second_per_grid_t`` (the frames' spacing in
time). The text after the item goes on from ``p + max(h, w)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def item_grid(item: Any) -> tuple[int, int, int]:
    """The item's patch grid ``(t, h, w)`` from its ``image_grid_thw`` or ``video_grid_thw``."""
    grid = item.features.get("video_grid_thw") if item.modality == "video" else None
    if grid is None:
        grid = item.features.get("image_grid_thw", item.features.get("video_grid_thw"))
    if grid is None:
        raise ValueError(f"a {item.modality} item carries no image_grid_thw or video_grid_thw "
                         f"(features: {', '.join(sorted(item.features)) or 'none'})")
    t, h, w = (int(v) for v in grid.reshape(-1)[:3].tolist())
    return t, h, w


def time_interval(item: Any, tokens_per_second: float | None) -> Any:
    """The temporal position step between an item's merged frames: 1, or for a video of a model
    with ``tokens_per_second`` (Qwen2.5-VL) that times the item's ``second_per_grid_ts`` (1 when the
    processor gave none), in float32 as the processor's tensor holds it."""
    if item.modality != "video" or tokens_per_second is None:
        return 1
    seconds = item.features.get("second_per_grid_ts")
    if seconds is None:
        return tokens_per_second
    return tokens_per_second * torch.as_tensor(seconds, dtype=torch.float32).reshape(-1)[0]


def mrope_positions(num_tokens: int, items: Sequence[Any], merge: int,
                    tokens_per_second: float | None = None) -> tuple[torch.Tensor, int]:
    """``([3, num_tokens]`` int64 positions, ``delta``): token ``i`` past the prompt sits at
    ``i + delta`` in all three sections.

    Raises:
        ValueError: an item's placeholder run does not fit the prompt, overlaps another, or its
            length is not its grid's number of merged tokens.
    """
    out = torch.empty(3, num_tokens, dtype=torch.int64)
    cursor = 0  # next token index
    pos = 0  # next text position
    for item in sorted(items, key=lambda it: it.offset):
        if item.offset < cursor or item.offset + item.length > num_tokens:
            raise ValueError(f"{item.modality} placeholder run [{item.offset}, {item.offset + item.length}) overlaps "
                             f"another item or runs past the prompt's {num_tokens} tokens")
        out[:, cursor:item.offset] = torch.arange(pos, pos + item.offset - cursor)
        pos += item.offset - cursor
        t, h, w = item_grid(item)
        h, w = h // merge, w // merge
        if t * h * w != item.length:
            raise ValueError(f"{item.modality} with grid (t={t}, h={h * merge}, w={w * merge}) has {t * h * w} merged "
                             f"tokens but {item.length} placeholder tokens")
        frames = (torch.arange(t) * time_interval(item, tokens_per_second)).long()
        grid_t, grid_h, grid_w = torch.meshgrid(frames, torch.arange(h), torch.arange(w), indexing="ij")
        out[:, item.offset:item.offset + item.length] = torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + pos
        pos += max(h, w)
        cursor = item.offset + item.length
    out[:, cursor:] = torch.arange(pos, pos + num_tokens - cursor)
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return out, delta
