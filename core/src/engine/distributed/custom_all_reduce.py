"""``--enable-custom-all-reduce``: small tensor-parallel all-reduces in one kernel over peer memory."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.distributed.placement import placement_device_type

logger = logging.getLogger(__name__)


class OneShotAllReduce:
    """All-reduce of small messages in one kernel of this project (``engine.distributed.one_shot``):
    every rank copies its part into a symmetric buffer (torch symmetric memory, peer-to-peer over
    NVLink, never multicast), signals its peers, and sums every rank's copy locally.

    For decode-sized messages this replaces NCCL's launch and protocol overhead (the issue's
    measurement: 17.5-24 us per 8 KB NCCL all-reduce on H200 x2). Capturable in CUDA graphs.
    Messages above ``MAX_BYTES``, not 16-byte multiples or not contiguous go to NCCL.
    """

    # Faster than NCCL from 8 KB to 2 MiB on two H200s (docs/benchmarks.md#parallelism).
    MAX_BYTES = 2 << 20

    def __init__(self, group_name: str, device: torch.device) -> None:
        self.group_name = group_name
        self.device = device
        # One set of peer buffers per dtype, made (a collective) on the first all-reduce of it:
        # every rank runs the same layers in the same order, so they make it together.
        self.buffers: dict[torch.dtype, Any] = {}

    @classmethod
    def create(cls, group: Any, backend: str, local_rank: int, one_host: bool = True) -> OneShotAllReduce | None:
        """The all-reduce, or None (with a warning naming why) where it cannot run: a backend
        other than NCCL, a tensor-parallel group spanning hosts (``one_host`` False: peer
        memory needs every rank on one machine), a torch without symmetric memory."""
        if backend != "nccl":
            logger.warning("--enable-custom-all-reduce: needs CUDA (NCCL); backend is %s: using it as is", backend)
            return None
        if not one_host:
            logger.warning("--enable-custom-all-reduce: the tensor-parallel group spans several hosts; using NCCL")
            return None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            symm_mem.rendezvous  # noqa: B018 - present in this torch?
        except (ImportError, AttributeError, RuntimeError) as exc:
            logger.warning("--enable-custom-all-reduce: torch %s has no symmetric memory (%s); using NCCL",
                           torch.__version__, exc)
            return None
        logger.info("tensor-parallel all-reduces up to %d MiB: one-shot over peer memory", cls.MAX_BYTES >> 20)
        return cls(group.group_name, torch.device(placement_device_type(backend), local_rank))

    def __call__(self, x: torch.Tensor) -> bool:
        """Sums ``x`` over the group in place; False (nothing done) when ``x`` does not qualify."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.MAX_BYTES or nbytes % 16 or not x.is_cuda or not x.is_contiguous():
            return False
        peers = self.buffers.get(x.dtype)
        if peers is None:
            from engine.distributed.one_shot import PeerBuffers

            peers = self.buffers[x.dtype] = PeerBuffers(self.group_name, self.device, x.dtype, self.MAX_BYTES)
        peers.all_reduce_(x)
        return True
