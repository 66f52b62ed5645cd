"""Where one scheduler process sits in its replica: rank, tensor- and pipeline-parallel position.

A plain picklable value, handed from the launcher to each rank's process; nothing here touches
torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankPlacement:
    """Where one scheduler process sits in its replica (picklable: handed to the child)."""

    # Rank in the replica's world, 0 .. tp_size * pp_size - 1; rank 0 talks to the tokenizer.
    rank: int
    tp_size: int
    pp_size: int
    # Index of this rank's device on its node (cuda:local_rank).
    local_rank: int
    # torch.distributed rendezvous, "tcp://HOST:PORT" (rank 0 listens there).
    init_method: str
    # Seconds a collective (and a node joining at start-up) may wait before failing.
    timeout_s: float
    # Expert-parallel size (--ep-size, a divisor of tp_size): MoE layers split their experts
    # this many ways across the tensor-parallel ranks (engine.layers.moe).
    ep_size: int = 1
    # DP attention (--enable-dp-attention): this replica's index among the dp_attn_size replicas
    # whose MLPs run tensor-parallel together (engine.distributed.dp_attention); 1: off.
    dp_attn_rank: int = 0
    dp_attn_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    def describe(self) -> str:
        if self.dp_attn_size > 1:
            return f"DP-attention rank {self.dp_attn_rank}/{self.dp_attn_size}"
        return f"rank {self.rank} (tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size})"


SINGLE = RankPlacement(rank=0, tp_size=1, pp_size=1, local_rank=0, init_method="", timeout_s=0.0)


def placement_device_type(backend: str) -> str:
    """The device type of a torch.distributed device backend ("nccl" -> "cuda", ...)."""
    return {"nccl": "cuda", "hccl": "npu", "xccl": "xpu"}.get(backend, "cuda")
