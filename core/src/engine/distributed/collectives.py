"""Collectives over a group: tensor-parallel sums and gathers on the device backend, and the
scheduler's control traffic (objects, agreed minimums) on the world's gloo CPU group.

Every function is the identity at size 1, so a single-process run never touches
torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.distributed.parallel_state import STATE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` over the tensor-parallel group, in place (identity at size 1)."""
    if STATE.tp_size == 1:
        return x
    if STATE.one_shot is not None and STATE.one_shot(x):
        return x
    torch.distributed.all_reduce(x, group=STATE.tp_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates ``x`` from every rank along ``dim`` (identity at size 1)."""
    if STATE.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(STATE.tp_size)]
    torch.distributed.all_gather(parts, x, group=STATE.tp_group)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Overwrites ``x`` with the stage's tensor-parallel rank 0's (in place; identity at size 1)."""
    if STATE.tp_size == 1:
        return x
    src = STATE.placement.pp_rank * STATE.placement.tp_size
    torch.distributed.broadcast(x, src=src, group=STATE.tp_group)
    return x


def broadcast_objects(objects: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``objects`` on every rank (the others pass anything, e.g. None).

    An empty list (what rank 0 has on most scheduler turns) costs one small collective (the
    pickled size, 0); anything else a second one with the pickled bytes.
    """
    if STATE.placement.world_size == 1:
        return objects
    import pickle

    dist = torch.distributed
    payload = b""
    if STATE.placement.rank == src and not (isinstance(objects, list) and not objects):
        payload = pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=STATE.cpu_group)
    n = int(size.item())
    if n == 0:
        return objects if STATE.placement.rank == src else []
    if STATE.placement.rank == src:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(data, src=src, group=STATE.cpu_group)
    return objects if STATE.placement.rank == src else pickle.loads(data.numpy().tobytes())


def all_reduce_min(value: int) -> int:
    """The smallest ``value`` over every rank of the replica (e.g. the KV pool size they agree on)."""
    if STATE.placement.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=STATE.cpu_group)
    return int(t.item())
