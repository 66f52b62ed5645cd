"""Copies between the device KV pool and a storage tier, off the compute stream on CUDA.

Ordering on CUDA, which is what makes reusing freed device slots safe:

* backup (device -> tier): the gather of the evicted slots runs on the compute stream, so any
  later kernel that overwrites those slots (their next owner's prefill) is queued after it; the
  device -> host copy of the gathered rows runs on a side copy stream and overlaps compute. The
  tier's ``write`` happens when that copy's event has completed (``poll``), or at once before
  anything that reads or frees the tier slots (``complete_writes``).
* load (tier -> device): the host -> device copy and the scatter into the freshly allocated
  slots run on the copy stream after it waited for the compute stream (the slots' previous
  contents may still be read by queued kernels); ``wait_loads`` makes the compute stream wait
  for the loads issued so far, before the forward that reads them. The CPU never blocks.

On the CPU (and devices without streams) the same calls run synchronously, in order.

An "mla" pool (``pool.kv_layout``) keeps V as a view of the leading dims of its K rows: only the
K rows move, and the tier's layout has ``v_head_dim`` 0 (``KvLayout.of_pool``), so it receives
and returns empty V tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.mem_cache.kv_tier import KvStorageTier


@dataclass
class _PendingWrite:
    event: Any
    slots: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    # Device tensors the copy reads: kept alive until it has finished.
    sources: list[torch.Tensor]


class KvTransfer:
    """Moves KV slot contents between ``pool`` (an ``MHATokenToKVPool`` or ``MLATokenToKVPool``)
    and ``tier``."""

    def __init__(self, pool: Any, tier: KvStorageTier, device: torch.device | str,
                 platform: Any | None = None) -> None:
        self.pool = pool
        self.tier = tier
        self.key_only = getattr(pool, "kv_layout", "mha") == "mla"
        if self.key_only and tier.layout.v_head_dim != 0:
            raise ValueError(f"{type(tier).__name__}: layout v_head_dim {tier.layout.v_head_dim} for an 'mla' KV "
                             "pool, whose V lives in its K rows; accepted: 0 (KvLayout.of_pool(pool, ...))")
        # The device buffers a copy writes: V views of an MLA pool are written through K.
        self._dest = pool.k_buffer if self.key_only else pool.k_buffer + pool.v_buffer
        self.device = torch.device(device)
        # Streams and events come from the platform (engine.platforms); without one, or on a
        # device without streams, every copy runs synchronously.
        self.platform = platform
        self.copy_stream = platform.create_stream() if platform is not None and self.device.type != "cpu" else None
        self.is_cuda = self.copy_stream is not None
        self._pending: list[_PendingWrite] = []
        self._load_events: list[tuple[Any, list[torch.Tensor], torch.Tensor]] = []
        self.bytes_per_token = tier.layout.bytes_per_token()
        # Counters for metrics.
        self.tokens_written = 0
        self.tokens_loaded = 0

    # -- device -> tier ---------------------------------------------------------------
    def backup(self, device_slots: torch.Tensor, tier_slots: torch.Tensor) -> None:
        """Copies the KV at ``device_slots`` to ``tier_slots``; the device slots may be freed
        (and reused) as soon as this returns."""
        self.tokens_written += len(device_slots)
        idx = device_slots.to(self.device, torch.int64)
        ks = [buf[idx] for buf in self.pool.k_buffer]
        if self.key_only:
            vs = [torch.empty((len(idx), t.shape[1], 0), dtype=t.dtype) for t in ks]
        else:
            vs = [buf[idx] for buf in self.pool.v_buffer]
        if not self.is_cuda:
            self.tier.write(tier_slots, [t.cpu() for t in ks], [t.cpu() for t in vs])
            return
        self._copy_stream_waits_for_compute()
        srcs = ks if self.key_only else ks + vs
        with self.platform.stream_context(self.copy_stream):
            hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in srcs]
            for dst, src in zip(hosts, srcs, strict=True):
                dst.copy_(src, non_blocking=True)
            event = self.platform.create_event()
            event.record(self.copy_stream)
        n = len(ks)
        self._pending.append(_PendingWrite(event, tier_slots, hosts[:n], vs if self.key_only else hosts[n:], srcs))

    def _copy_stream_waits_for_compute(self) -> None:
        """Queues on the copy stream a wait for everything issued so far on the current stream."""
        marker = self.platform.create_event()
        marker.record()  # on the current (compute) stream
        self.copy_stream.wait_event(marker)

    def poll(self) -> None:
        """Hands finished device -> host copies to the tier (never blocks)."""
        while self._pending and self._pending[0].event.query():
            self._finish(self._pending.pop(0))

    def complete_writes(self) -> None:
        """Waits for every pending copy and hands it to the tier: call before reading or freeing
        tier slots."""
        while self._pending:
            write = self._pending.pop(0)
            write.event.synchronize()
            self._finish(write)

    def _finish(self, write: _PendingWrite) -> None:
        self.tier.write(write.slots, write.k, write.v)

    # -- tier -> device -------------------------------------------------------------------
    def load(self, tier_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copies the KV at ``tier_slots`` into ``device_slots`` (freshly allocated)."""
        self.complete_writes()
        self.tokens_loaded += len(tier_slots)
        ks, vs = self.tier.read(tier_slots)
        srcs = ks if self.key_only else ks + vs
        idx = device_slots.to(self.device, torch.int64)
        if not self.is_cuda:
            for buf, src in zip(self._dest, srcs, strict=True):
                buf[idx] = src.to(buf.dtype)
            return
        if not self.tier.returns_pinned:
            srcs = [t.pin_memory() for t in srcs]
        self._copy_stream_waits_for_compute()
        with self.platform.stream_context(self.copy_stream):
            for buf, src in zip(self._dest, srcs, strict=True):
                staged = src.to(self.device, non_blocking=True)
                buf[idx] = staged
            event = self.platform.create_event()
            event.record(self.copy_stream)
        # The pinned sources and the index (made on the compute stream, read on the copy stream)
        # must outlive the asynchronous copies: the entry keeps them until its event completes.
        self._load_events.append((event, srcs, idx))

    def wait_loads(self) -> None:
        """Makes the compute stream wait for the loads issued so far (no CPU wait)."""
        if not self._load_events:
            return
        for event, _, _ in self._load_events:
            event.wait()  # the current (compute) stream waits; the CPU does not
        self._load_events = [e for e in self._load_events if not e[0].query()]

    def reset(self) -> None:
        """Drops queued work (the cache is being emptied): finishes copies, forgets loads."""
        for write in self._pending:
            write.event.synchronize()
        self._pending = []
        for event, _, _ in self._load_events:
            event.synchronize()
        self._load_events = []

    @property
    def bytes_written(self) -> int:
        return self.tokens_written * self.bytes_per_token

    @property
    def bytes_loaded(self) -> int:
        return self.tokens_loaded * self.bytes_per_token
