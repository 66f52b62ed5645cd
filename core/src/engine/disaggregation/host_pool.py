"""Host memory for a prefill server's KV payloads, taken once when the server starts.

Taking pinned host memory is slow (on an H200 host ~100 ms per 224 MiB) and, while it runs,
another thread's kernel launches stall (up to ~150 ms measured): the scheduler's prefills. A
prefill server therefore takes one pinned slab of ``size`` bytes at start-up, before it
serves, and carves each payload's K and V out of it. A payload's bytes are a tensor of their
own over the slab (``torch.frombuffer``), so the pool sees, through a weak reference to that
tensor's storage, when the transfer backend has let the payload go (sent, expired or
discarded) and reuses its bytes. A payload that does not fit gets fresh memory instead
(``HostPool.fresh`` counts them).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# Offsets within the slab are multiples of this (any element size; page-aligned copies).
ALIGN = 4096


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HostPool:
    """``take(k_like, v_like)`` gives host tensors shaped and typed like the two, out of the slab
    when a gap fits (``None`` otherwise). One thread takes; any thread may read ``used_bytes``."""

    def __init__(self, size: int, pin: bool) -> None:
        if size < 0:
            raise ValueError(f"host pool size: invalid value {size}; accepted: 0 (no pool) or more bytes")
        self.size = _round_up(size) if size else 0
        self.pin = pin
        self._slab = torch.empty(self.size, dtype=torch.uint8, pin_memory=pin) if self.size else None
        self._bytes: Any = self._slab.numpy() if self._slab is not None else None
        # Payloads' regions in the slab, by offset: (offset, size, weak reference to their storage).
        self._live: list[tuple[int, int, StorageWeakRef]] = []
        self.taken = 0  # payloads placed in the slab
        self.fresh = 0  # payloads that got fresh memory instead (the slab was full, or too small)

    def take(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Host tensors for ``k`` and ``v`` (shapes and dtypes) in one free region of the slab,
        or ``None`` when no free region is large enough for both."""
        k_bytes, v_bytes = k.nbytes, v.nbytes
        need = _round_up(k_bytes) + _round_up(v_bytes)
        offset = self._gap(need)
        if offset is None:
            return None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            region = torch.frombuffer(self._bytes[offset:offset + need], dtype=torch.uint8)
        # A new list, not sorted in place: ``used_bytes`` may be reading the old one.
        self._live = sorted([*self._live, (offset, need, StorageWeakRef(region.untyped_storage()))], key=lambda r: r[0])
        self.taken += 1
        v_at = _round_up(k_bytes)
        return _typed(region[:k_bytes], k), _typed(region[v_at:v_at + v_bytes], v)

    def take_fresh(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tensors for ``k`` and ``v`` outside the slab (torch's caching host allocator)."""
        self.fresh += 1
        return tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin) for t in (k, v))  # type: ignore[return-value]

    def fits(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the pair can ever be placed in the slab (a larger one gets fresh memory at once)."""
        need = _round_up(k.nbytes) + _round_up(v.nbytes)
        return 0 < need <= self.size

    def used_bytes(self) -> int:
        """Bytes of the slab that payloads still held by the backend occupy."""
        return sum(size for _, size, ref in list(self._live) if not ref.expired())

    def _gap(self, need: int) -> int | None:
        """The lowest offset of a free region of ``need`` bytes (regions let go are freed first)."""
        if not need or need > self.size:
            return None
        self._live = [r for r in self._live if not r[2].expired()]
        start = 0
        for offset, size, _ in self._live:
            if offset - start >= need:
                return start
            start = offset + size
        return start if self.size - start >= need else None


def _typed(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``raw`` bytes as a tensor of ``like``'s dtype and shape (no copy)."""
    if not raw.numel():
        return torch.empty(like.shape, dtype=like.dtype)
    return raw.view(like.dtype).view(like.shape)
