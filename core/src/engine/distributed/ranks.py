"""Where the scheduler ranks of one replica run: this node's ranks, their devices and rendezvous.

A replica is ``tp_size * pp_size`` ranks spread evenly over ``--nnodes`` machines: node ``n``
runs ranks ``n * per_node .. (n + 1) * per_node - 1``, on its local devices starting at
``dp_rank * per_node``. Starting and watching the processes is the launcher's
(``engine.entrypoints.node_ranks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.distributed.placement import RankPlacement
from engine.ports import free_port

if TYPE_CHECKING:
    from engine.config import ServerArgs

_DEFAULT_DIST_PORT = 29500


def init_method(args: ServerArgs, dp_rank: int) -> str:
    """The rendezvous of replica ``dp_rank``: ``--dist-init-addr`` (its port + dp_rank), or a free
    local port on a single node."""
    if args.dist_init_addr:
        host, _, port = args.dist_init_addr.rpartition(":")
        return f"tcp://{host}:{int(port) + dp_rank}"
    return f"tcp://127.0.0.1:{free_port()}"


def dp_attention_init_method(args: ServerArgs) -> str:
    """The one rendezvous every replica of a DP-attention server joins (``--dist-init-addr``, or a
    free local port picked once for ``args``: the launcher asks once per replica)."""
    if args.dist_init_addr:
        return init_method(args, 0)
    key = id(args)
    if key not in _DP_ATTENTION_METHODS:
        _DP_ATTENTION_METHODS.clear()  # an earlier server's; its port is free again
        _DP_ATTENTION_METHODS[key] = f"tcp://127.0.0.1:{free_port()}"
    return _DP_ATTENTION_METHODS[key]


_DP_ATTENTION_METHODS: dict[int, str] = {}


def node_placements(args: ServerArgs, dp_rank: int, method: str) -> list[RankPlacement]:
    """The ranks of replica ``dp_rank`` this node (``--node-rank``) runs.

    With DP attention a replica is one rank (attention is not split), on local device ``dp_rank``,
    and ``method`` is the rendezvous of all ``--dp-size`` replicas (``dp_attention_init_method``)."""
    if getattr(args, "enable_dp_attention", False):
        return [RankPlacement(rank=0, tp_size=1, pp_size=1, local_rank=dp_rank, init_method=method,
                              timeout_s=args.dist_timeout_s, ep_size=args.ep_size, dp_attn_rank=dp_rank,
                              dp_attn_size=args.dp_size)]
    world = args.tp_size * args.pp_size
    per_node = world // args.nnodes
    first = args.node_rank * per_node
    return [RankPlacement(rank=r, tp_size=args.tp_size, pp_size=args.pp_size, ep_size=args.ep_size,
                          local_rank=dp_rank * per_node + (r - first), init_method=method,
                          timeout_s=args.dist_timeout_s)
            for r in range(first, first + per_node)]


def rank_name(dp_rank: int, args: ServerArgs, placement: RankPlacement) -> str:
    """The process name the watchdog reports ("scheduler", "scheduler dp1", "scheduler rank 1 (tp 1, pp 0)")."""
    name = "scheduler" if args.dp_size == 1 else f"scheduler dp{dp_rank}"
    if placement.world_size > 1:
        name += f" rank {placement.rank} (tp {placement.tp_rank}, pp {placement.pp_rank})"
    return name
