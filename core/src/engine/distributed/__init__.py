"""Process groups for tensor parallelism.

Only a tensor-parallel size of 1 runs today; layers already ask these functions
for their rank and size so that adding tensor parallelism changes no model plugin.
"""

from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` over the tensor-parallel group (identity at size 1)."""
    if _TP_SIZE == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates ``x`` from every rank along ``dim`` (identity at size 1)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator
