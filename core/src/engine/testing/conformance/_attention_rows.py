"""How the attention kit draws its batches: rows of cached prefix and new tokens per mode."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

# How a random batch of each mode is drawn: (rows, prefix range, new tokens per row).
MAX_PREFIX, MAX_EXTEND = 90, 40
# FP8 KV case: per-layer scales that are not powers of two (so a scale applied wrongly or not
# at all changes the result), and one key/value element far past the format's range (the write
# must saturate: a float -> fp8 cast of an overflowing value gives NaN on GPUs).
FP8_K_SCALE, FP8_V_SCALE, FP8_OUTLIER = 0.0371, 0.0219, 1.0e4


@dataclass
class Rows:
    """The rows of one drawn batch: extend rows first, then decode rows (the MIXED layout)."""

    prefix: list[int]  # cached tokens per row
    extend: list[int]  # new tokens per row (1 for decode rows)
    num_extend_reqs: int  # leading rows that are extend rows


def draw_rows(rng: random.Random, mode: str) -> Rows:
    if mode == "decode":
        bs = rng.randint(1, 6)
        return Rows([rng.randint(0, MAX_PREFIX) for _ in range(bs)], [1] * bs, 0)
    n_ext = rng.randint(1, 6) if mode == "extend" else rng.randint(1, 3)
    n_dec = 0 if mode == "extend" else rng.randint(1, 4)
    prefix = [rng.randint(0, MAX_PREFIX) for _ in range(n_ext)]
    prefix += [rng.randint(1, MAX_PREFIX) for _ in range(n_dec)]  # a decode row follows its prompt
    extend = [rng.randint(1, MAX_EXTEND) for _ in range(n_ext)] + [1] * n_dec
    return Rows(prefix, extend, n_ext)


def place_rows(r2t: Any, alloc: Any, slots: list[int], prefix: list[int], ext: list[int],
               pre_loc: torch.Tensor) -> torch.Tensor:
    """Writes each row's prefix slots into its request slot, allocates the new tokens' slots
    after them (continuing a row's last page) and writes those; returns the new tokens' slots."""
    off = 0
    for i, p in enumerate(prefix):
        r2t.write(slots[i], 0, pre_loc[off : off + p])
        off += p
    last = [int(r2t.req_to_token[slots[i], p - 1]) if p else -1 for i, p in enumerate(prefix)]
    new_loc = alloc.alloc_extend(prefix, [p + e for p, e in zip(prefix, ext, strict=True)], last)
    off = 0
    for i, (p, e) in enumerate(zip(prefix, ext, strict=True)):
        r2t.write(slots[i], p, new_loc[off : off + e])
        off += e
    return new_loc
