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
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


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
        return f"rank {self.rank} (tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size})"


SINGLE = RankPlacement(rank=0, tp_size=1, pp_size=1, local_rank=0, init_method="", timeout_s=0.0)

_PLACEMENT = SINGLE
_TP_RANK = 0
_TP_SIZE = 1
_EP_SIZE = 1
_TP_GROUP: Any = None  # device-backend group of this rank's pipeline stage
_CPU_GROUP: Any = None  # gloo group over the world (control messages)
_ONE_SHOT: Any = None  # --enable-custom-all-reduce: small all-reduces over peer memory


def get_placement() -> RankPlacement:
    return _PLACEMENT


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    return _TP_SIZE


def get_expert_parallel_world_size() -> int:
    """How many ways MoE layers split their experts (1: every rank holds every expert)."""
    return _EP_SIZE


def set_expert_parallel(size: int) -> None:
    """Sets the expert-parallel size layers see, without process groups (tests building one shard)."""
    global _EP_SIZE
    _EP_SIZE = size


def get_pipeline_model_parallel_rank() -> int:
    return _PLACEMENT.pp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return _PLACEMENT.pp_size


def is_first_pp_rank() -> bool:
    return _PLACEMENT.pp_rank == 0


def is_last_pp_rank() -> bool:
    return _PLACEMENT.pp_rank == _PLACEMENT.pp_size - 1


def set_tensor_model_parallel(rank: int, size: int) -> None:
    """Sets the rank and size layers see, without process groups (tests building one shard)."""
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, size


def init_distributed(placement: RankPlacement, backend: str, custom_all_reduce: bool = False) -> None:
    """Joins the replica's process groups (every rank calls this, in any order).

    Raises ``EngineError`` with one line when the other ranks do not join within
    ``placement.timeout_s`` (a node that never started, a wrong ``--dist-init-addr``).
    ``custom_all_reduce`` (NCCL only): tensor-parallel all-reduces of small messages run as one
    kernel over peer memory (``OneShotAllReduce``) instead of NCCL.
    """
    import torch.distributed as dist

    from engine.errors import EngineError

    global _PLACEMENT, _TP_GROUP, _CPU_GROUP, _ONE_SHOT
    set_tensor_model_parallel(placement.tp_rank, placement.tp_size)
    set_expert_parallel(placement.ep_size)
    _PLACEMENT = placement
    if placement.world_size == 1:
        return
    timeout = datetime.timedelta(seconds=placement.timeout_s)
    try:
        dist.init_process_group(backend=backend, init_method=placement.init_method, rank=placement.rank,
                                world_size=placement.world_size, timeout=timeout)
        _CPU_GROUP = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        # Every rank creates every group, in the same order (torch.distributed requires it).
        for stage in range(placement.pp_size):
            ranks = list(range(stage * placement.tp_size, (stage + 1) * placement.tp_size))
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
            if stage == placement.pp_rank:
                _TP_GROUP = group
        # A first collective: every rank is in before any of them loads weights.
        dist.barrier(group=_CPU_GROUP)
        if backend != "gloo":
            # Create the device communicator now (NCCL does it lazily), before the KV pool is
            # sized from free memory and never inside a CUDA-graph capture.
            dist.all_reduce(torch.zeros(1, device=torch.device(placement_device_type(backend), placement.local_rank)),
                            group=_TP_GROUP)
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
        _ONE_SHOT = OneShotAllReduce.create(_TP_GROUP, backend, placement.local_rank,
                                            tp_group_on_one_host(placement))


def tp_group_on_one_host(placement: RankPlacement) -> bool:
    """Whether every rank of this rank's tensor-parallel group runs on this host (a collective
    over the world's CPU group: every rank must call it)."""
    import socket

    import torch.distributed as dist

    hosts: list[Any] = [None] * placement.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=_CPU_GROUP)
    first = placement.pp_rank * placement.tp_size
    return len(set(hosts[first:first + placement.tp_size])) == 1


def placement_device_type(backend: str) -> str:
    """The device type of a torch.distributed device backend ("nccl" -> "cuda", ...)."""
    return {"nccl": "cuda", "hccl": "npu", "xccl": "xpu"}.get(backend, "cuda")


def destroy_distributed() -> None:
    global _PLACEMENT, _TP_GROUP, _CPU_GROUP, _ONE_SHOT
    if _PLACEMENT.world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _PLACEMENT, _TP_GROUP, _CPU_GROUP, _ONE_SHOT = SINGLE, None, None, None
    set_tensor_model_parallel(0, 1)
    set_expert_parallel(1)


# -- tensor-parallel collectives ------------------------------------------------------------
def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` over the tensor-parallel group, in place (identity at size 1)."""
    if _TP_SIZE == 1:
        return x
    if _ONE_SHOT is not None and _ONE_SHOT(x):
        return x
    torch.distributed.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates ``x`` from every rank along ``dim`` (identity at size 1)."""
    if _TP_SIZE == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    torch.distributed.all_gather(parts, x, group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Overwrites ``x`` with the stage's tensor-parallel rank 0's (in place; identity at size 1)."""
    if _TP_SIZE == 1:
        return x
    src = _PLACEMENT.pp_rank * _PLACEMENT.tp_size
    torch.distributed.broadcast(x, src=src, group=_TP_GROUP)
    return x


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


# -- control traffic over the CPU group -----------------------------------------------------
def broadcast_objects(objects: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``objects`` on every rank (the others pass anything, e.g. None).

    An empty list (what rank 0 has on most scheduler turns) costs one small collective (the
    pickled size, 0); anything else a second one with the pickled bytes.
    """
    if _PLACEMENT.world_size == 1:
        return objects
    import pickle

    dist = torch.distributed
    payload = b""
    if _PLACEMENT.rank == src and not (isinstance(objects, list) and not objects):
        payload = pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=_CPU_GROUP)
    n = int(size.item())
    if n == 0:
        return objects if _PLACEMENT.rank == src else []
    if _PLACEMENT.rank == src:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(data, src=src, group=_CPU_GROUP)
    return objects if _PLACEMENT.rank == src else pickle.loads(data.numpy().tobytes())


def all_reduce_min(value: int) -> int:
    """The smallest ``value`` over every rank of the replica (e.g. the KV pool size they agree on)."""
    if _PLACEMENT.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=_CPU_GROUP)
    return int(t.item())


# -- pipeline point-to-point ----------------------------------------------------------------
class PendingSends:
    """Sends in flight (``pp_isend``); the tensors stay referenced until ``wait``."""

    def __init__(self, works: list[Any], tensors: list[torch.Tensor]) -> None:
        self.works = works
        self.tensors = tensors

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.tensors = []


    def done(self) -> bool:
        """True once every send completed; raises the error of one that failed (a peer that
        exited), so a sender that never receives still notices."""
        if not all(work.is_completed() for work in self.works):
            return False
        self.wait()
        return True


def pp_isend(tensors: list[torch.Tensor]) -> PendingSends:
    """Sends ``tensors`` to the same tensor-parallel rank of the next pipeline stage, without
    waiting for it to receive them (``wait()`` on the result does)."""
    dst = _PLACEMENT.rank + _PLACEMENT.tp_size
    tensors = [t.contiguous() for t in tensors]
    return PendingSends([torch.distributed.isend(t, dst=dst, tag=TAG_HIDDEN) for t in tensors], tensors)


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Receives tensors of ``shapes`` from the same tensor-parallel rank of the previous stage."""
    src = _PLACEMENT.rank - _PLACEMENT.tp_size
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.recv(t, src=src, tag=TAG_HIDDEN)
        out.append(t)
    return out


# Point-to-point streams between two ranks are told apart by tag; each is FIFO, so a receiver
# takes a stream's messages in the order they were sent.
TAG_HIDDEN = 1  # hidden states and residuals, stage to stage (world group, device backend)
TAG_MESSAGES = 2  # rank 0's scheduler messages of each turn, to every other rank (CPU group)
TAG_SAMPLES = 3  # the last stage's sampled ids of each micro-batch, to every other rank (CPU group)


def isend_objects(objects: Any, dsts: list[int], tag: int) -> PendingSends:
    """Sends picklable ``objects`` to each of ``dsts`` over the CPU group without waiting.

    Two messages per destination: the pickled size (int64) and, when not zero, the bytes. An
    empty list (a scheduler turn with no new request) sends only the size 0. The receiver calls
    ``recv_objects`` with the same tag; the sender keeps the result until its sends completed.
    """
    import pickle

    dist = torch.distributed
    payload = b"" if isinstance(objects, list) and not objects else pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    tensors = [size]
    works = []
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else None
    if data is not None:
        tensors.append(data)
    for dst in dsts:
        works.append(dist.isend(size, dst=dst, group=_CPU_GROUP, tag=tag))
        if data is not None:
            works.append(dist.isend(data, dst=dst, group=_CPU_GROUP, tag=tag))
    return PendingSends(works, tensors)


def recv_objects(src: int, tag: int) -> Any:
    """What rank ``src`` sent with ``isend_objects`` on ``tag`` (``[]`` for an empty list)."""
    import pickle

    dist = torch.distributed
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=_CPU_GROUP, tag=tag)
    n = int(size.item())
    if n == 0:
        return []
    data = torch.empty(n, dtype=torch.uint8)
    dist.recv(data, src=src, group=_CPU_GROUP, tag=tag)
    return pickle.loads(data.numpy().tobytes())


def last_stage_rank() -> int:
    """World rank of tensor-parallel rank 0 of the last pipeline stage (where sampling happens)."""
    return (_PLACEMENT.pp_size - 1) * _PLACEMENT.tp_size


def check_model_parallel(hf_config: Any, tp_size: int, pp_size: int, ep_size: int = 1) -> None:
    """Raises ``ConfigError`` (one line) when the model cannot be split ``tp_size`` x ``pp_size`` ways.

    The vocabulary never limits ``tp_size``: embedding and LM head rows are padded to a multiple
    of it (the padding rows are zero and their logits are cut off).
    """
    from engine.errors import ConfigError

    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    intermediate = getattr(hf_config, "intermediate_size", None)

    def fits(tp: int) -> bool:
        kv_ok = kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0
        return heads % tp == 0 and kv_ok and (intermediate is None or int(intermediate) % tp == 0)

    if not fits(tp_size):
        accepted = ", ".join(str(t) for t in range(1, heads + 1) if fits(t))
        what = f"{heads} attention heads, {kv_heads} KV heads"
        if intermediate is not None:
            what += f", MLP size {intermediate}"
        raise ConfigError(f"--tp-size: invalid value {tp_size} for this model ({what}): each must split "
                          f"evenly across ranks (KV heads may instead be replicated when fewer than ranks); "
                          f"accepted: {accepted}")
    _check_expert_parallel(hf_config, tp_size, ep_size)
    layers = int(hf_config.num_hidden_layers)
    if pp_size > layers:
        raise ConfigError(f"--pp-size: invalid value {pp_size}; accepted: at most the model's {layers} layers "
                          "(each pipeline stage needs one)")


def _check_expert_parallel(hf_config: Any, tp_size: int, ep_size: int) -> None:
    """A mixture-of-experts model splits its experts ``ep_size`` ways and each expert's
    intermediate features ``tp_size / ep_size`` ways (engine.layers.moe.layer)."""
    from engine.errors import ConfigError

    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    if not experts:
        return
    experts = int(experts)
    if experts % ep_size:
        accepted = ", ".join(str(e) for e in range(1, tp_size + 1) if tp_size % e == 0 and experts % e == 0)
        raise ConfigError(f"--ep-size: invalid value {ep_size} for this model ({experts} experts): the experts must "
                          f"split evenly across expert-parallel ranks; accepted: {accepted}")
    inter = getattr(hf_config, "moe_intermediate_size", None) or getattr(hf_config, "intermediate_size", None)
    if inter is not None and int(inter) % (tp_size // ep_size):
        raise ConfigError(f"--tp-size {tp_size} with --ep-size {ep_size}: each expert's {inter} intermediate features "
                          f"must split evenly over {tp_size // ep_size} ranks; raise --ep-size or lower --tp-size")


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator
