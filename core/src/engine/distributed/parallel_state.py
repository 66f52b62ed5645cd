"""This process's place in the replica and its process groups: joined once, read by every layer.

Layers ask these functions for their rank and size, so a model plugin needs no change for tensor
parallelism. At size 1 (the default) nothing is initialised and torch.distributed is never
imported. Tests set a rank and size without process groups (``set_tensor_model_parallel``).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.distributed.custom_all_reduce import OneShotAllReduce
from engine.distributed.placement import SINGLE, RankPlacement, placement_device_type

logger = logging.getLogger(__name__)


@dataclass
class ParallelState:
    """What ``init_distributed`` set up; one instance per process (``STATE``)."""

    # This process's rank and replica shape.
    placement: RankPlacement = SINGLE
    # Tensor-parallel rank and size layers shard by (set without groups by tests).
    tp_rank: int = 0
    tp_size: int = 1
    # Ways MoE layers split their experts.
    ep_size: int = 1
    # Device-backend group of this rank's pipeline stage (None at size 1).
    tp_group: Any = None
    # Gloo group over the world, for control messages (None at size 1).
    cpu_group: Any = None
    # --enable-custom-all-reduce: small all-reduces over peer memory (None: NCCL only).
    one_shot: OneShotAllReduce | None = None
    # DP attention (engine.distributed.dp_attention): the replicas' group on the device backend
    # and on gloo (None when off).
    dp_attn_group: Any = None
    dp_attn_cpu_group: Any = None


STATE = ParallelState()


def get_placement() -> RankPlacement:
    return STATE.placement


def get_tensor_model_parallel_rank() -> int:
    return STATE.tp_rank


def get_tensor_model_parallel_world_size() -> int:
    return STATE.tp_size


def get_expert_parallel_world_size() -> int:
    """How many ways MoE layers split their experts (1: every rank holds every expert)."""
    return STATE.ep_size


def set_expert_parallel(size: int) -> None:
    """Sets the expert-parallel size layers see, without process groups (tests building one shard)."""
    STATE.ep_size = size


def get_pipeline_model_parallel_rank() -> int:
    return STATE.placement.pp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return STATE.placement.pp_size


def is_first_pp_rank() -> bool:
    return STATE.placement.pp_rank == 0


def is_last_pp_rank() -> bool:
    return STATE.placement.pp_rank == STATE.placement.pp_size - 1


def last_stage_rank() -> int:
    """World rank of tensor-parallel rank 0 of the last pipeline stage (where sampling happens)."""
    return (STATE.placement.pp_size - 1) * STATE.placement.tp_size


def set_tensor_model_parallel(rank: int, size: int) -> None:
    """Sets the rank and size layers see, without process groups (tests building one shard)."""
    STATE.tp_rank, STATE.tp_size = rank, size


def init_distributed(placement: RankPlacement, backend: str, custom_all_reduce: bool = False) -> None:
    """Joins the replica's process groups (every rank calls this, in any order).

    Raises ``EngineError`` with one line when the other ranks do not join within
    ``placement.timeout_s`` (a node that never started, a wrong ``--dist-init-addr``).
    ``custom_all_reduce`` (NCCL only): tensor-parallel all-reduces of small messages run as one
    kernel over peer memory (``OneShotAllReduce``) instead of NCCL.
    """
    import torch.distributed as dist

    from engine.errors import EngineError

    set_tensor_model_parallel(placement.tp_rank, placement.tp_size)
    set_expert_parallel(placement.ep_size)
    STATE.placement = placement
    if placement.world_size == 1:
        if placement.dp_attn_size > 1:
            _join_dp_attention(placement, backend or "gloo")
        return
    timeout = datetime.timedelta(seconds=placement.timeout_s)
    try:
        dist.init_process_group(backend=backend, init_method=placement.init_method, rank=placement.rank,
                                world_size=placement.world_size, timeout=timeout)
        STATE.cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        # Every rank creates every group, in the same order (torch.distributed requires it).
        for stage in range(placement.pp_size):
            ranks = list(range(stage * placement.tp_size, (stage + 1) * placement.tp_size))
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
            if stage == placement.pp_rank:
                STATE.tp_group = group
        # A first collective: every rank is in before any of them loads weights.
        dist.barrier(group=STATE.cpu_group)
        if backend != "gloo":
            # Create the device communicator now (NCCL does it lazily), before the KV pool is
            # sized from free memory and never inside a CUDA-graph capture.
            dist.all_reduce(torch.zeros(1, device=torch.device(placement_device_type(backend), placement.local_rank)),
                            group=STATE.tp_group)
    except Exception as exc:
        # torch's own text spans many lines; the first says what happened.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EngineError(
            f"{placement.describe()}: the {placement.world_size} ranks did not all join at "
            f"{placement.init_method} within {placement.timeout_s:g} s (--dist-timeout-s): {first}. "
            "Check that every node was started with the same --dist-init-addr, --nnodes, --tp-size "
            "and --pp-size") from None
    logger.info("%s joined %s (%s)", placement.describe(), placement.init_method, backend)
    if custom_all_reduce and placement.tp_size > 1:
        STATE.one_shot = OneShotAllReduce.create(STATE.tp_group, backend, placement.local_rank,
                                                 tp_group_on_one_host(placement))


def _join_dp_attention(placement: RankPlacement, backend: str) -> None:
    """Joins the group of the ``dp_attn_size`` replicas, each one rank (``--enable-dp-attention``):
    their MLPs split across it. The rest of the model is whole on every replica (ep size 1)."""
    import torch.distributed as dist

    from engine.errors import EngineError

    STATE.ep_size = 1
    timeout = datetime.timedelta(seconds=placement.timeout_s)
    try:
        dist.init_process_group(backend=backend, init_method=placement.init_method, rank=placement.dp_attn_rank,
                                world_size=placement.dp_attn_size, timeout=timeout)
        STATE.dp_attn_group = dist.group.WORLD
        STATE.dp_attn_cpu_group = (STATE.dp_attn_group if backend == "gloo"
                                   else dist.new_group(backend="gloo", timeout=timeout))
        dist.barrier(group=STATE.dp_attn_cpu_group)
        if backend != "gloo":  # the device communicator now, before the KV pool takes free memory
            dist.all_reduce(torch.zeros(1, device=torch.device(placement_device_type(backend), placement.local_rank)),
                            group=STATE.dp_attn_group)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EngineError(f"{placement.describe()}: the {placement.dp_attn_size} DP-attention replicas did not all "
                          f"join at {placement.init_method} within {placement.timeout_s:g} s: {first}") from None
    logger.info("%s joined %s (%s)", placement.describe(), placement.init_method, backend)


def tp_group_on_one_host(placement: RankPlacement) -> bool:
    """Whether every rank of this rank's tensor-parallel group runs on this host (a collective
    over the world's CPU group: every rank must call it)."""
    import socket

    import torch.distributed as dist

    hosts: list[Any] = [None] * placement.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=STATE.cpu_group)
    first = placement.pp_rank * placement.tp_size
    return len(set(hosts[first:first + placement.tp_size])) == 1


def destroy_distributed() -> None:
    if STATE.placement.world_size > 1 or STATE.placement.dp_attn_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    STATE.placement, STATE.tp_group, STATE.cpu_group, STATE.one_shot = SINGLE, None, None, None
    STATE.dp_attn_group = STATE.dp_attn_cpu_group = None
    set_tensor_model_parallel(0, 1)
    set_expert_parallel(1)
