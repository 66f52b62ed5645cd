"""A prefill server's copies of finished prompts' KV to host memory, off the scheduler's thread.

A 4,096-token prompt of a small model carries hundreds of MiB of KV (Qwen3-0.6B: 448 MiB); its
device-to-host copy takes ~10 ms on an H200. Waited for in the scheduler's thread, that copy
stalls the next batch's prefill. Here the scheduler only gathers the prompt's rows out of the
pool into a device staging tensor (on the compute stream, so a later batch that reuses the slots
is queued after the gather) and records an event behind the gather. One thread per prefill
server then, payload by payload in hand-over order: takes host memory for it out of the pinned
pool (``HostPool``), queues the copy on a copy stream that waits for that event, waits for the
copy alone, lets the device staging go and hands the payload to the transfer backend
(``publish``).

``max_bytes`` bounds the device staging of handed-over copies not yet complete: beyond it the
scheduler waits for the oldest ones before gathering more. The pinned pool (``pool_bytes``,
taken when the stager starts: a fresh pinned block costs ~100 ms per 224 MiB on an H200 host,
during which another thread's kernel launches stall for up to ~150 ms) holds the payloads the
backend has not let go yet (sent, expired or discarded); its bytes are reused after that. A
payload that finds no room waits (up to ``HOST_POOL_WAIT_S``) for the backend to let one go, which
also paces the copies to a slow transfer, then takes fresh memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.disaggregation.host_pool import HostPool
from engine.disaggregation.transfer import HOST_POOL_BYTES, HOST_POOL_WAIT_S, KvPayload

logger = logging.getLogger(__name__)

# Device staging of handed-over copies in flight at most, before the scheduler waits for the
# oldest ones (two 4,096-token prompts of an 8B model with 8 KV heads).
MAX_STAGING_BYTES = 1 << 30


class _Closed(Exception):
    """The stager was closed while a payload waited for host memory."""


@dataclass
class HostCopy:
    """One payload's KV on its way to host memory: ``sources`` (K and V on the device) are
    complete once ``marker`` (recorded on the compute stream) has passed."""

    marker: Any
    sources: tuple[torch.Tensor, torch.Tensor]
    nbytes: int


class KvStager:
    """``gathered(k, v)`` (scheduler's thread, behind the gather) makes a ``HostCopy``;
    ``publish_after`` (once the batch has finished) hands it over with the payload to publish."""

    def __init__(self, platform: Any, device: torch.device, publish: Callable[[str, KvPayload], None],
                 max_bytes: int = MAX_STAGING_BYTES, pool_bytes: int = HOST_POOL_BYTES) -> None:
        self.platform = platform
        self.device = torch.device(device)
        self._publish = publish
        self.max_bytes = max_bytes
        # Taken here, before the server serves: never beside the scheduler's launches.
        pin = bool(platform.pin_host_memory())
        try:
            self._pool = HostPool(pool_bytes, pin=pin)
        except RuntimeError as exc:  # the host refused that much pinned memory: serve without the pool
            logger.warning("KV transfer: no pinned pool of %.2f GiB (%s); each payload takes fresh pinned memory, "
                           "which stalls kernel launches: lower host_pool_gb", pool_bytes / (1 << 30), exc)
            self._pool = HostPool(0, pin=pin)
        self.held_waits = 0  # payloads that waited for the backend to let one go
        self._stream = platform.create_stream()
        self._todo: deque[tuple[HostCopy, str, KvPayload, dict[str, Any] | None, float]] = deque()
        self._inflight = 0  # handed over and not yet copied: their count and device bytes
        self._inflight_bytes = 0
        self._cv = threading.Condition()
        self._stopped = False
        # Held by the thread from its last look at ``_stopped`` through ``publish``: once close()
        # has taken it, nothing more is published.
        self._gate = threading.Lock()
        self.waits = 0  # how often the bound made the scheduler wait for copies
        self._thread = threading.Thread(target=self._run, name="kv-stage", daemon=True)
        self._thread.start()

    # -- the scheduler's thread ------------------------------------------------------------
    def gathered(self, k: torch.Tensor, v: torch.Tensor) -> HostCopy:
        """Marks the device tensors ``k`` and ``v`` just gathered on the current stream as a
        copy to make (waits first while the bound's worth of copies is in flight)."""
        nbytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        with self._cv:
            if self._inflight and self._inflight_bytes + nbytes > self.max_bytes:
                self.waits += 1
                while not self._stopped and self._inflight and self._inflight_bytes + nbytes > self.max_bytes:
                    self._cv.wait()
        marker = self.platform.create_event()
        marker.record()  # on the current (compute) stream, behind the gather
        return HostCopy(marker, (k, v), nbytes)

    def publish_after(self, copy: HostCopy, key: str, payload: KvPayload,
                      record: dict[str, Any] | None = None) -> None:
        """Publishes ``payload`` with ``copy``'s K and V (in place of its own) in host memory once
        copied; ``record["copy_s"]`` (the one place it is kept) then gets the seconds from this
        call to the end of the copy.
        (A copy never handed over is simply dropped: only the compute stream has used it.)"""
        with self._cv:
            if self._stopped:  # closed, or the thread could not start: nothing would ever copy it
                return
            self._inflight += 1
            self._inflight_bytes += copy.nbytes
            self._todo.append((copy, key, payload, record, time.perf_counter()))
            self._cv.notify_all()

    def busy(self) -> bool:
        """Payloads handed over and not yet published."""
        return self._inflight > 0

    def close(self) -> None:
        """Stops the thread; payloads not yet published, a copy under way included, are dropped
        (the server is stopping: their decode servers' fetches fail). Nothing is published once
        this returns (the backend is closed next)."""
        with self._cv:
            self._stopped = True
            self._todo.clear()
            self._cv.notify_all()
        # A publish under way ends first; a copy under way sees ``_stopped`` when it ends.
        if not self._gate.acquire(timeout=2):
            logger.warning("KV transfer: a publish did not end within 2 s of closing the staging thread")
        else:
            self._gate.release()
        if self._thread is not threading.current_thread():
            self._thread.join(2)
            if self._thread.is_alive():  # a daemon: it does not hold the process's exit up
                logger.warning("KV transfer: the staging thread did not stop within 2 s (a copy still running)")
        with self._cv:
            self._inflight = self._inflight_bytes = 0

    # -- the stager's thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.device.type != "cpu":
                self.platform.set_device(self.device)
        except Exception:  # noqa: BLE001 - without its thread the stager stops: no caller may wait on it
            logger.exception("KV transfer: the staging thread could not start on %s; prompts' KV is not published "
                             "(their decode servers' fetches fail by their deadline)", self.device)
            with self._cv:
                self._stopped = True
                self._todo.clear()
                self._inflight = self._inflight_bytes = 0
                self._cv.notify_all()
            return
        while True:
            with self._cv:
                while not self._stopped and not self._todo:
                    self._cv.wait()
                if self._stopped:
                    return
                copy, key, payload, record, handed = self._todo.popleft()
            nbytes = copy.nbytes
            try:
                payload = self._copy(copy, payload)
                if record is not None:
                    record["copy_s"] = round(time.perf_counter() - handed, 6)
                with self._gate:
                    if self._stopped:  # closed while this one copied: the backend is going
                        continue
                    self._publish(key, payload)
            except _Closed:  # closed while it waited for host memory: dropped, like the queued ones
                continue
            except Exception:  # noqa: BLE001 - one payload lost (its fetch fails by its deadline), not the thread
                logger.exception("KV transfer: staging %s failed", key)
            finally:
                copy.sources = ()  # the device staging may go
                # Nothing of this payload stays referenced here while the thread waits for the next.
                del copy, payload, record
                with self._cv:
                    self._inflight = max(self._inflight - 1, 0)
                    self._inflight_bytes = max(self._inflight_bytes - nbytes, 0)
                    self._cv.notify_all()

    def stats(self) -> dict[str, Any]:
        """For /get_server_info (any thread): payloads copying, the pinned pool (its size, the
        bytes of payloads the backend still holds, payloads that found no room and took fresh
        memory), and how often the two bounds made the scheduler or this thread wait."""
        return {"copying": self._inflight, "pool_bytes": self._pool.size, "held_bytes": self._pool.used_bytes(),
                "fresh": self._pool.fresh, "staging_waits": self.waits, "held_waits": self.held_waits}

    def _host_for(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tensors for one payload: out of the pool, waiting up to ``HOST_POOL_WAIT_S`` for the
        backend to let payloads go when it is full; fresh memory past that (or when the payload
        is larger than the whole pool). Raises ``_Closed`` when the stager is closed during the
        wait: the payload is dropped unpublished, so it takes no fresh pinned memory (whose
        allocation stalls the scheduler's launches) on the way out."""
        if not self._pool.fits(k, v):
            return self._pool.take_fresh(k, v)
        got = self._pool.take(k, v)
        if got is None:
            self.held_waits += 1
            deadline = time.monotonic() + HOST_POOL_WAIT_S
            while got is None and not self._stopped and time.monotonic() < deadline:
                time.sleep(0.002)
                got = self._pool.take(k, v)
        if got is None and self._stopped:
            raise _Closed
        return got if got is not None else self._pool.take_fresh(k, v)

    def _copy(self, copy: HostCopy, payload: KvPayload) -> KvPayload:
        """``payload`` with ``copy``'s K and V copied into pinned host memory (this thread waits
        for the copy alone; the compute stream runs on)."""
        k, v = self._host_for(*copy.sources)
        with self.platform.stream_context(self._stream):
            self._stream.wait_event(copy.marker)
            for dst, src in ((k, copy.sources[0]), (v, copy.sources[1])):
                if src.numel():
                    dst.copy_(src, non_blocking=True)
            done = self.platform.create_event()
            done.record(self._stream)
        done.synchronize()
        return KvPayload(payload.first_token, k, v, payload.meta)
