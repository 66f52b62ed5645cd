"""Copies between the device KV pool and a storage tier, off the compute stream on CUDA.

Two paths:

* **rows** (a tier with ``host_rows()``, the built-in host tier): the tier's storage is one host
  tensor with a row per slot holding every layer's K and V. A backup gathers the device slots of
  every layer into a device staging tensor in that row layout (one gather per layer and one
  transpose, on the compute stream), then copies it to the tier's rows with one DMA copy per run
  of consecutive tier slots on the copy stream. A load does the reverse on the copy stream: one
  DMA copy per run into a device staging tensor, then one scatter per layer into the pool. The
  CPU never waits and the tier's ``write``/``read`` are not called: every copy into or out of
  the rows is queued on the one copy stream, in order, so a tier slot that is freed and reused
  (or read back) is ordered after the copy that wrote it.
* **generic** (any other tier, e.g. a file): a backup gathers on the compute stream and copies
  the gathered rows to pinned host memory on the copy stream; the tier's ``write`` receives them
  when that copy's event has completed (``poll``), or at once before anything reads or frees
  tier slots (``complete_writes``). A load reads the tier on the CPU, copies to the device and
  scatters into the slots on the copy stream.

Ordering on CUDA, which is what makes reusing freed device slots safe: the gather of evicted
slots runs on the compute stream, so a later kernel that overwrites them (their next owner's
prefill) is queued after it; a load's copy stream first waits for the compute stream (the slots'
previous contents may still be read by queued kernels), and ``wait_loads`` makes the compute
stream wait for the loads issued so far before the forward that reads them.

On the CPU (and devices without streams) the same calls run synchronously, in order.

An "mla" pool (``pool.kv_layout``) keeps V as a view of the leading dims of its K rows: only the
K rows move, and the tier's layout has ``v_head_dim`` 0 (``KvLayout.of_pool``), so it receives
and returns empty V tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.mem_cache.kv_tier import KvStorageTier

logger = logging.getLogger(__name__)


@dataclass
class _PendingWrite:
    event: Any
    slots: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    # Device tensors the copy reads: kept alive until it has finished.
    sources: list[torch.Tensor]


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first slot, position in slots, length)`` of each run of consecutive slots, in order."""
    n = len(slots)
    if n == 0:
        return []
    breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, n]
    firsts = slots[starts].tolist()
    return [(f, a, b - a) for f, a, b in zip(firsts, starts, ends, strict=True)]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """One-byte float types as uint8: the copies move bytes, and every index kernel takes uint8."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8) else t


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
        self.rows = self._usable_rows(tier.host_rows())
        # On a GPU, one Triton launch gathers (or scatters) every layer's slots instead of one
        # torch op per layer; used once it reproduces the torch path on scratch buffers here.
        self._table = self._kernel_table() if self.rows is not None and self.is_cuda else None
        self._pending: list[_PendingWrite] = []
        # Copies in flight on the copy stream: (event, tensors they read or write).
        self._inflight: list[tuple[Any, list[torch.Tensor]]] = []
        self._load_events: list[tuple[Any, list[torch.Tensor], torch.Tensor]] = []
        self.bytes_per_token = tier.layout.bytes_per_token()
        # Counters for metrics.
        self.tokens_written = 0
        self.tokens_loaded = 0

    def _usable_rows(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The tier's rows in byte-moving form when their shape fits the pool (else the generic path)."""
        if rows is None:
            return None
        parts = self._dest
        ok = (rows.dim() == 4 and rows.shape[1] == len(parts) and rows.dtype == parts[0].dtype
              and all(rows.shape[2] == p.shape[1] and p.shape[2] <= rows.shape[3] for p in parts)
              and (not self.is_cuda or rows.is_pinned()))
        if not ok:
            logger.warning("hierarchical cache: %s's host_rows() (shape %s, %s, pinned %s) do not fit the pool's "
                           "%d parts of %s; copying through its write/read, one torch op per layer",
                           type(self.tier).__name__, tuple(rows.shape), rows.dtype, rows.is_pinned(), len(parts),
                           parts[0].dtype)
            return None
        return _raw(rows)

    def _kernel_table(self) -> Any:
        """A ``PartTable`` over the pool once the kernel reproduced torch's gather and scatter on
        scratch buffers of the pool's shapes (same compile, this device); None otherwise."""
        from engine.mem_cache.kv_copy_kernel import PartTable

        rows = self.rows
        assert rows is not None
        heads, width = rows.shape[2], rows.shape[3]
        parts = [_raw(p) for p in self._dest]
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            scratch = [torch.randint(0, 120, (16, heads, p.shape[2]), generator=gen, dtype=torch.uint8)
                       .view(p.dtype).to(self.device) if p.element_size() == 1 else
                       torch.randn(16, heads, p.shape[2], generator=gen).to(p.dtype).to(self.device) for p in parts]
            check = PartTable(scratch, heads, width)
            idx = torch.tensor([5, 0, 9, 3], dtype=torch.int64, device=self.device)
            got = check.gather(idx)
            ok = all(torch.equal(got[:, j, :, : p.shape[2]], p[idx]) for j, p in enumerate(scratch))
            dest = torch.tensor([1, 2, 7, 15], dtype=torch.int64, device=self.device)
            check.scatter(dest, got)
            ok = ok and all(torch.equal(p[dest], p[idx]) for p in scratch)
            table = PartTable(parts, heads, width) if ok else None
        except Exception as exc:  # noqa: BLE001 - any failure means the torch path
            logger.warning("hierarchical cache: the Triton KV copy kernel is unavailable (%s: %s); "
                           "copying with one torch op per layer", type(exc).__name__, exc)
            return None
        if table is None:
            logger.warning("hierarchical cache: the Triton KV copy kernel disagreed with torch on this device; "
                           "copying with one torch op per layer")
        return table

    # -- device -> tier ---------------------------------------------------------------
    def backup(self, device_slots: torch.Tensor, tier_slots: torch.Tensor) -> None:
        """Copies the KV at ``device_slots`` to ``tier_slots``; the device slots may be freed
        (and reused) as soon as this returns."""
        self.tokens_written += len(device_slots)
        idx = device_slots.to(self.device, torch.int64)
        if self.rows is not None:
            self._backup_rows(idx, tier_slots)
            return
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

    def _backup_rows(self, idx: torch.Tensor, tier_slots: torch.Tensor) -> None:
        rows = self.rows
        assert rows is not None
        parts, heads, width = rows.shape[1:]
        # On the compute stream, ahead of any reuse of the slots.
        if self._table is not None:
            tok = self._table.gather(idx)
        else:
            # Layer-major (each gather writes a contiguous block), then transposed into the rows'
            # token-major layout.
            stage = torch.empty((parts, len(idx), heads, width), dtype=rows.dtype, device=self.device)
            for j, buf in enumerate(self._dest):
                buf = _raw(buf)
                if buf.shape[2] == width:
                    torch.index_select(buf, 0, idx, out=stage[j])
                else:
                    stage[j, :, :, : buf.shape[2]] = buf[idx]
            tok = stage.transpose(0, 1).contiguous()
        runs = slot_runs(tier_slots)
        if not self.is_cuda:
            for first, pos, length in runs:
                rows[first : first + length].copy_(tok[pos : pos + length])
            return
        self._copy_stream_waits_for_compute()
        with self.platform.stream_context(self.copy_stream):
            for first, pos, length in runs:
                rows[first : first + length].copy_(tok[pos : pos + length], non_blocking=True)
            event = self.platform.create_event()
            event.record(self.copy_stream)
        self._inflight.append((event, [tok]))  # the copy reads tok until its event completes

    def _copy_stream_waits_for_compute(self) -> None:
        """Queues on the copy stream a wait for everything issued so far on the current stream."""
        marker = self.platform.create_event()
        marker.record()  # on the current (compute) stream
        self.copy_stream.wait_event(marker)

    def poll(self) -> None:
        """Hands finished device -> host copies to the tier and releases their buffers (never blocks)."""
        while self._pending and self._pending[0].event.query():
            self._finish(self._pending.pop(0))
        while self._inflight and self._inflight[0][0].query():
            self._inflight.pop(0)

    def complete_writes(self) -> None:
        """Makes every backup visible to the tier's own ``read`` and safe to free: waits for the
        generic path's copies and hands them to the tier. The rows path needs no wait (its
        copies are ordered on the copy stream), so it only releases what has finished."""
        while self._pending:
            write = self._pending.pop(0)
            write.event.synchronize()
            self._finish(write)
        self.poll()

    def _finish(self, write: _PendingWrite) -> None:
        self.tier.write(write.slots, write.k, write.v)

    # -- tier -> device -------------------------------------------------------------------
    def load(self, tier_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copies the KV at ``tier_slots`` into ``device_slots`` (freshly allocated)."""
        self.tokens_loaded += len(tier_slots)
        idx = device_slots.to(self.device, torch.int64)
        if self.rows is not None:
            self._load_rows(tier_slots, idx)
            return
        self.complete_writes()
        ks, vs = self.tier.read(tier_slots)
        srcs = ks if self.key_only else ks + vs
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

    def _load_rows(self, tier_slots: torch.Tensor, idx: torch.Tensor) -> None:
        rows = self.rows
        assert rows is not None
        runs = slot_runs(tier_slots)

        def copy_in(non_blocking: bool) -> torch.Tensor:
            tok = torch.empty((len(idx), *rows.shape[1:]), dtype=rows.dtype, device=self.device)
            for first, pos, length in runs:
                tok[pos : pos + length].copy_(rows[first : first + length], non_blocking=non_blocking)
            if self._table is not None:
                self._table.scatter(idx, tok)
                return tok
            for j, buf in enumerate(self._dest):
                buf = _raw(buf)
                buf.index_copy_(0, idx, tok[:, j, :, : buf.shape[2]])
            return tok

        if not self.is_cuda:
            copy_in(False)
            return
        self._copy_stream_waits_for_compute()
        with self.platform.stream_context(self.copy_stream):
            tok = copy_in(True)
            event = self.platform.create_event()
            event.record(self.copy_stream)
        self._load_events.append((event, [tok], idx))

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
        for event, _ in self._inflight:
            event.synchronize()
        self._inflight = []
        for event, _, _ in self._load_events:
            event.synchronize()
        self._load_events = []

    @property
    def bytes_written(self) -> int:
        return self.tokens_written * self.bytes_per_token

    @property
    def bytes_loaded(self) -> int:
        return self.tokens_loaded * self.bytes_per_token
