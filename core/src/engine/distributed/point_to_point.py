"""Point-to-point traffic between pipeline stages: hidden states on the world group (device
backend) and the scheduler's per-turn messages on the CPU group, each stream told apart by tag.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.distributed.parallel_state import STATE


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
    dst = STATE.placement.rank + STATE.placement.tp_size
    tensors = [t.contiguous() for t in tensors]
    return PendingSends([torch.distributed.isend(t, dst=dst, tag=TAG_HIDDEN) for t in tensors], tensors)


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Receives tensors of ``shapes`` from the same tensor-parallel rank of the previous stage."""
    src = STATE.placement.rank - STATE.placement.tp_size
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
        works.append(dist.isend(size, dst=dst, group=STATE.cpu_group, tag=tag))
        if data is not None:
            works.append(dist.isend(data, dst=dst, group=STATE.cpu_group, tag=tag))
    return PendingSends(works, tensors)


def recv_objects(src: int, tag: int) -> Any:
    """What rank ``src`` sent with ``isend_objects`` on ``tag`` (``[]`` for an empty list)."""
    import pickle

    dist = torch.distributed
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=STATE.cpu_group, tag=tag)
    n = int(size.item())
    if n == 0:
        return []
    data = torch.empty(n, dtype=torch.uint8)
    dist.recv(data, src=src, group=STATE.cpu_group, tag=tag)
    return pickle.loads(data.numpy().tobytes())
