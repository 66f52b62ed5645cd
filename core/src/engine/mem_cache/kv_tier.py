"""KV storage tiers: where the hierarchical prefix cache keeps KV evicted from the device pool.

A tier stores K and V of single token slots, addressed by the tier's own slot numbers. The
hierarchical cache (``engine.mem_cache.hiradix_cache``) owns the bookkeeping: it allocates and
frees tier slots through the methods below (one allocator per tier, paged like the device
pool) and decides what is written and read back; a tier implements only ``write`` and ``read``
(plus ``close`` when it holds files or connections).

Tiers are plugins (``register_kv_storage_tiers`` / ``KvStorageTierSpec``, hook API 8):
``factory(layout: KvLayout, num_tokens: int, options: dict = ...) -> KvStorageTier``. The
built-in ``host`` tier keeps pages in (pinned, on CUDA) host memory; ``file`` (plugin
``kvtier-file``) keeps them in a file. Every tensor a tier receives or returns lives in host
memory: device <-> host copies are the cache's job (``engine.mem_cache.kv_transfer``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.errors import ConfigError
from engine.platforms import current_platform


@dataclass(frozen=True)
class KvLayout:
    """The shape of one rank's KV pool: what a tier must be able to store per token slot.

    With tensor parallelism every rank has its own pool shard (its KV heads) and its own tier
    instance; ``tp_rank`` lets a tier keep the ranks' data apart (file names, remote keys).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    page_size: int
    #: type of the device pool's device ("cpu", "cuda", ...): a host-memory tier pins its
    #: buffers when copies come from an accelerator.
    device_type: str = "cpu"
    tp_rank: int = 0
    tp_size: int = 1
    #: the device pool's ``kv_layout``: "mha", or "mla", whose V is a view of the leading dims of
    #: its K rows; an "mla" layout has ``v_head_dim == 0`` (tiers receive and return empty V).
    kv_layout: str = "mha"

    @classmethod
    def of_pool(cls, pool: Any, page_size: int, device_type: str = "cpu", tp_rank: int = 0,
                tp_size: int = 1) -> KvLayout:
        """The layout a tier needs for ``pool``: an MLA pool's K rows only (its V is inside them)."""
        kind = getattr(pool, "kv_layout", "mha")
        return cls(num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
                   v_head_dim=0 if kind == "mla" else pool.v_head_dim, dtype=pool.dtype, page_size=page_size,
                   device_type=device_type, tp_rank=tp_rank, tp_size=tp_size, kv_layout=kind)

    def bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers of this rank."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem


class KvStorageTier(ABC):
    """A slot-addressed KV store below the device pool (see the module docstring).

    Args:
        layout: the rank's KV layout; ``write`` receives and ``read`` returns per-layer tensors
            ``[n, num_kv_heads, head_dim]`` (V: ``v_head_dim``) of ``layout.dtype``; V tensors of
            an "mla" layout have no elements (``v_head_dim`` 0).
        num_tokens: capacity in token slots; rounded down to whole pages (at least one page).
    """

    #: ``read`` returns page-locked (pinned) host memory, so a copy to the device can be
    #: asynchronous; when False the cache pins a staging copy itself.
    returns_pinned: bool = False

    def __init__(self, layout: KvLayout, num_tokens: int) -> None:
        page = layout.page_size
        num_tokens = max(num_tokens // page * page, page)
        self.layout = layout
        self.size = num_tokens
        # Tier slots 1..size; slot page 0 stays unused, as in the device pool.
        self.allocator = _SlotBitmap(num_tokens, page)

    # -- slot bookkeeping (called by the cache) ---------------------------------
    def available_size(self) -> int:
        """Free token slots."""
        return self.allocator.available_size()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` free slots (a whole number of pages), or None when too few are free.

        The lowest free slots, ascending: they come in as few runs of consecutive slots as the
        free space allows (a tier with ``host_rows`` moves each run with one copy).
        """
        return self.allocator.alloc(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def clear(self) -> None:
        """Frees every slot (the cache forgets everything it stored)."""
        self.allocator.clear()

    # -- storage (implemented by a tier) -------------------------------------------
    @abstractmethod
    def write(self, slots: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Stores, for every layer ``i``, ``k[i][j]`` and ``v[i][j]`` at slot ``slots[j]``.

        ``slots`` is int64 on the CPU; the tensors are CPU tensors, one per layer.
        """

    @abstractmethod
    def read(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V stored at ``slots``, one ``[len(slots), heads, dim]`` CPU tensor per layer."""

    def host_rows(self) -> torch.Tensor | None:
        """The tier's storage as one host tensor ``[slots, parts, kv_heads, width]``, or None.

        A tier that keeps every slot as one row of a host tensor (pinned when ``layout.device_type``
        is an accelerator) returns it: parts are the K of each layer, then the V of each layer
        (none for an "mla" layout), each in the first ``head_dim`` / ``v_head_dim`` entries of
        ``width``. The cache then copies KV between the device and these rows itself, one DMA
        copy per run of consecutive slots on a side stream, and calls neither ``write`` nor
        ``read`` for its transfers.
        """
        return None

    def close(self) -> None:  # noqa: B027 (optional: a tier holding nothing to release keeps it)
        """Releases files, connections or memory; the tier is not used afterwards."""

    def describe(self) -> str:
        """One line for the start-up log."""
        gib = self.size * self.layout.bytes_per_token() / 2**30
        return f"{type(self).__name__}: {self.size} tokens ({gib:.2f} GiB)"


class HostMemoryTier(KvStorageTier):
    """The built-in ``host`` tier: one host-memory row per slot holding its K and V of every layer.

    The rows are one tensor ``[slots, parts, kv_heads, width]`` (``host_rows``): the K of each
    layer, then the V of each layer (none for an MLA layout), each padded to the widest part. A
    slot's KV is thus one contiguous run of bytes, and a run of consecutive slots too: the cache
    moves it to and from the device with one DMA copy (``engine.mem_cache.kv_transfer``). The
    rows are pinned when the device pool is on an accelerator (the copies are then asynchronous)
    and ordinary memory on the CPU, where pinning means nothing.
    """

    def __init__(self, layout: KvLayout, num_tokens: int) -> None:
        _check_host_memory((num_tokens + layout.page_size) * _row_bytes(layout))  # before any allocation
        super().__init__(layout, num_tokens)
        rows = self.size + layout.page_size
        # A pool on a CUDA device means CUDA is there to pin with.
        self.pinned = layout.device_type == "cuda"
        self.returns_pinned = self.pinned
        parts, width = _row_shape(layout)
        # Uninitialised: a slot is read only after it was written, and untouched pages of a large
        # tier cost nothing until used (pinned ones are locked at allocation anyway).
        shape = (rows, parts, layout.num_kv_heads, width)
        platform = current_platform()
        started = time.perf_counter()
        if self.pinned and platform is not None:
            self.rows = platform.alloc_pinned_host(shape, layout.dtype)  # exactly this size, locked
        else:
            self.rows = torch.empty(shape, dtype=layout.dtype, pin_memory=self.pinned)
        self.alloc_seconds = time.perf_counter() - started
        layers = layout.num_layers
        self.k_buffer = [self.rows[:, i, :, : layout.head_dim] for i in range(layers)]
        if layout.v_head_dim:
            self.v_buffer = [self.rows[:, layers + i, :, : layout.v_head_dim] for i in range(layers)]
        else:
            self.v_buffer = [self.rows[:, 0, :, :0] for _ in range(layers)]

    def host_rows(self) -> torch.Tensor | None:
        return self.rows

    def describe(self) -> str:
        pinned = f", pinned in {self.alloc_seconds:.1f} s" if self.pinned else ""
        return super().describe() + pinned

    def write(self, slots: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        for buf, src in zip(self.k_buffer + self.v_buffer, k + v, strict=True):
            buf[slots] = src

    def read(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        def gather(buf: torch.Tensor) -> torch.Tensor:
            out = torch.empty((len(slots), *buf.shape[1:]), dtype=buf.dtype, pin_memory=self.pinned)
            return torch.index_select(buf, 0, slots, out=out)

        return [gather(b) for b in self.k_buffer], [gather(b) for b in self.v_buffer]

    def close(self) -> None:
        self.k_buffer, self.v_buffer = [], []
        self.rows = torch.empty(0)


def _row_shape(layout: KvLayout) -> tuple[int, int]:
    """(parts, width) of a host row: K of each layer then V of each layer, padded to one width."""
    if layout.v_head_dim == 0:
        return layout.num_layers, layout.head_dim
    return 2 * layout.num_layers, max(layout.head_dim, layout.v_head_dim)


def _row_bytes(layout: KvLayout) -> int:
    parts, width = _row_shape(layout)
    return parts * layout.num_kv_heads * width * torch.empty((), dtype=layout.dtype).element_size()


class _SlotBitmap:
    """Free tier pages as a mask: an allocation takes the lowest free pages, so the slots of a
    transfer form long runs of consecutive slots. One pass over the mask per allocation (about
    0.1 ms for a million pages), where keeping a free list sorted would sort it on every one."""

    def __init__(self, size: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_mask = np.zeros(size // page_size + 1, dtype=bool)
        self.clear()

    def clear(self) -> None:
        self.free_mask[1:] = True  # page 0 is never handed out
        self.free_pages = len(self.free_mask) - 1

    def available_size(self) -> int:
        return self.free_pages * self.page_size

    def alloc(self, need: int) -> torch.Tensor | None:
        assert need % self.page_size == 0, "tier allocations are whole pages"
        count = need // self.page_size
        if count > self.free_pages:
            return None
        pages = np.flatnonzero(self.free_mask)[:count]
        self.free_mask[pages] = False
        self.free_pages -= count
        slots = (pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)
        return torch.from_numpy(slots.astype(np.int64))

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        pages = np.unique(slots.numpy() // self.page_size)
        pages = pages[~self.free_mask[pages]]  # a page is freed once, whichever of its slots come
        self.free_mask[pages] = True
        self.free_pages += len(pages)


def _available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_host_memory(need: int) -> None:
    """Refuses a tier the machine's free memory cannot hold (it would be killed, not slowed)."""
    available = _available_host_bytes()
    if available is not None and need > 0.9 * available:
        raise ConfigError(f"--hicache-size/--hicache-ratio: the host tier of this rank needs {need / 2**30:.1f} GiB "
                          f"but {available / 2**30:.1f} GiB of host memory are available; accepted: a tier "
                          f"within 90% of it (a smaller --hicache-size or --hicache-ratio, or the file tier)")
