"""A decode server's copies of arrived KV payloads to the pool's device, off the scheduler's thread.

A 4,096-token prompt of a small model carries hundreds of MiB of KV (Qwen3-0.6B: 448 MiB).
Copied to the device by the scheduler's thread, from the transfer's pageable buffers, it
would stall the decode loop for tens of milliseconds per arriving request: every running
request's next token would wait. Here one thread per decode server copies each payload to
the device on a side stream and waits for that copy alone; the scheduler takes uploaded
payloads in arrival order and only scatters them into the pool (device to device).

Payloads already on the pool's device (NCCL transfers) and pools on the CPU pass through.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import torch

from engine.disaggregation.transfer import KvPayload

logger = logging.getLogger(__name__)

# Uploaded payloads waiting for admission at most (each holds its KV on the device twice over
# until it is written: a bound on that memory when the pool has no room for them yet).
_MAX_AHEAD = 2


class KvUploader:
    """``submit(item, payload)`` in arrival order; ``done()`` returns ``(item, payload)`` pairs
    whose ``k``/``v`` are on ``device``, in the same order, with ``meta["upload_s"]``; the
    scheduler ``release``s each one written into the pool (or dropped), which lets the next
    upload start when ``_MAX_AHEAD`` were waiting."""

    def __init__(self, platform: Any, device: torch.device, threaded: bool | None = None) -> None:
        self.platform = platform
        self.device = torch.device(device)
        self._threaded = self.device.type != "cpu" if threaded is None else threaded
        self._todo: deque[tuple[Any, KvPayload]] = deque()
        self._done: deque[tuple[Any, KvPayload]] = deque()
        self._busy = 0  # submitted and not yet taken by ``done``
        self._held = 0  # uploaded and not yet released
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        if self._threaded:
            self._stream = platform.create_stream() if platform is not None else None
            self._thread = threading.Thread(target=self._run, name="kv-upload", daemon=True)
            self._thread.start()

    def submit(self, item: Any, payload: KvPayload) -> None:
        with self._cv:
            self._busy += 1
            if not self._threaded:
                self._held += 1
                self._done.append((item, payload))
                return
            self._todo.append((item, payload))
            self._cv.notify_all()

    def done(self, wait_s: float = 0.0) -> list[tuple[Any, KvPayload]]:
        """The payloads uploaded since the last call (waits up to ``wait_s`` for the first)."""
        with self._cv:
            if not self._done and wait_s > 0 and self._busy:
                self._cv.wait(wait_s)
            out = list(self._done)
            self._done.clear()
            self._busy -= len(out)
        return out

    def release(self, n: int = 1) -> None:
        """``n`` uploaded payloads are in the pool (or dropped): their device copies may go."""
        with self._cv:
            self._held = max(self._held - n, 0)
            self._cv.notify_all()

    def busy(self) -> bool:
        return self._busy > 0

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._todo.clear()
            self._done.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(5)
            if self._thread.is_alive():  # a daemon: it does not hold the process's exit up
                logger.warning("KV transfer: the upload thread did not stop within 5 s (an upload still running)")

    def _run(self) -> None:
        if self.platform is not None and self.device.type != "cpu":
            self.platform.set_device(self.device)
        while True:
            with self._cv:
                while not self._stopped and (not self._todo or self._held >= _MAX_AHEAD):
                    self._cv.wait()
                if self._stopped:
                    return
                item, payload = self._todo.popleft()
                self._held += 1
            payload = self._upload(payload)
            with self._cv:
                self._done.append((item, payload))
                self._cv.notify_all()
            # The scheduler owns it now: this thread's names would keep the device copy of the
            # last payload allocated while the server is idle.
            del item, payload

    def _upload(self, payload: KvPayload) -> KvPayload:
        if payload.k.device == self.device:
            return payload
        started = time.perf_counter()
        with self.platform.stream_context(self._stream):
            k = payload.k.to(self.device, non_blocking=True)
            v = payload.v.to(self.device, non_blocking=True)
            event = self.platform.create_event()
            if event is not None:
                event.record()  # on the side stream
        if event is not None:
            event.synchronize()  # this copy only: the decode loop's stream runs on
        else:
            self.platform.synchronize()
        meta = {**payload.meta, "upload_s": time.perf_counter() - started}
        return KvPayload(payload.first_token, k, v, meta)
