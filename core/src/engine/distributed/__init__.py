"""Process groups for tensor and pipeline parallelism, on torch.distributed.

One replica runs ``tp_size * pp_size`` ranks, one process each. Rank ``r`` is pipeline stage
``r // tp_size`` and tensor-parallel rank ``r % tp_size``. Three kinds of group:

- the world group, on the platform's device backend (NCCL on GPUs, gloo on the CPU): the
  point-to-point hidden states between pipeline stages;
- a gloo CPU group over the whole world: the scheduler's control traffic (rank 0 broadcasts the
  requests it received so every rank builds the same batch; the KV pool size is agreed on);
- one tensor-parallel group per pipeline stage, on the device backend: the all-reduce after
  row-parallel layers, the all-gather of the vocabulary-parallel LM head, the broadcast of
  sampled ids.

At size 1 (the default) nothing is initialised and every collective is the identity, so a
single-process run never imports or touches torch.distributed. Layers ask these functions for
their rank and size, so a model plugin needs no change for tensor parallelism.

The names below are the package's API (layers and plugins import them from ``engine.distributed``);
each lives in a module of its own concern: ``placement`` (where a rank sits), ``parallel_state``
(the groups this process joined), ``collectives`` (group-wide operations), ``point_to_point``
(pipeline traffic), ``custom_all_reduce`` (the one-shot all-reduce), ``model_split`` (whether a
model splits that many ways), ``dp_attention`` (the MLPs split across data-parallel replicas:
``data_parallel_mlp`` builds a layer's MLP for it). ``ranks`` (where each rank of a replica runs) and ``one_shot`` (the
kernel) are imported by name where needed.
"""

from __future__ import annotations

from engine.distributed.collectives import (
    all_reduce_min,
    broadcast_objects,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_broadcast,
)
from engine.distributed.custom_all_reduce import OneShotAllReduce
from engine.distributed.dp_attention import data_parallel_mlp, dp_attention_size
from engine.distributed.model_split import check_model_parallel, divide
from engine.distributed.parallel_state import (
    destroy_distributed,
    get_expert_parallel_world_size,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_placement,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_distributed,
    is_first_pp_rank,
    is_last_pp_rank,
    last_stage_rank,
    set_expert_parallel,
    set_tensor_model_parallel,
    tp_group_on_one_host,
)
from engine.distributed.placement import SINGLE, RankPlacement, placement_device_type
from engine.distributed.point_to_point import (
    TAG_HIDDEN,
    TAG_MESSAGES,
    TAG_SAMPLES,
    PendingSends,
    isend_objects,
    pp_isend,
    pp_recv,
    recv_objects,
)

__all__ = [
    "SINGLE",
    "TAG_HIDDEN",
    "TAG_MESSAGES",
    "TAG_SAMPLES",
    "OneShotAllReduce",
    "PendingSends",
    "RankPlacement",
    "all_reduce_min",
    "broadcast_objects",
    "check_model_parallel",
    "data_parallel_mlp",
    "destroy_distributed",
    "divide",
    "dp_attention_size",
    "get_expert_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_placement",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "init_distributed",
    "is_first_pp_rank",
    "is_last_pp_rank",
    "isend_objects",
    "last_stage_rank",
    "placement_device_type",
    "pp_isend",
    "pp_recv",
    "recv_objects",
    "set_expert_parallel",
    "set_tensor_model_parallel",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_broadcast",
    "tp_group_on_one_host",
]
