"""``engine serve --node-rank N`` (N > 0): a node that runs only its scheduler ranks, no server."""

from __future__ import annotations

import logging
import os
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import ServerArgs

logger = logging.getLogger(__name__)


def serve_worker_node(args: ServerArgs) -> int:
    """``engine serve --node-rank N`` (N > 0): run this node's ranks of every replica, no server.

    The ranks take their work from rank 0 on node 0 (``--dist-init-addr``). Returns 0 when node 0
    stopped them, 1 when one of them failed (the others on this node are then killed).
    """
    from engine.entrypoints.launch import check_parallel_layout, resolve_model_path
    from engine.entrypoints.node_ranks import ReplicaReady, launch_ranks, watch_node_ranks
    from engine.managers.process_utils import setup_child_logging
    from engine.model_executor.checkpoint import load_hf_config
    from engine.selection import select_components

    setup_child_logging(args.log_level, f"node {args.node_rank}")
    model_path = resolve_model_path(args)
    config = load_hf_config(model_path, args.trust_remote_code)
    check_parallel_layout(args, config, select_components(args, config).platform)
    processes: list[Any] = []
    readers: list[Connection] = []
    for dp_rank in range(args.dp_size):
        procs, ready = launch_ranks(args, model_path, None, dp_rank, os.getpid())
        processes += procs
        readers += ready.readers
    logger.info("node %d of %d: started %d rank(s); joining rank 0 at %s", args.node_rank, args.nnodes,
                len(processes), args.dist_init_addr)
    return watch_node_ranks(processes, ReplicaReady(readers, processes), args.node_rank)
