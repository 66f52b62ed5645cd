"""``ZmqKvTransfer``: KV payloads over ZeroMQ/TCP, served by a thread per backend.

Prefill role: a ROUTER socket on ``ctx.host:ctx.port`` answers decode servers' fetches; a
payload published before its fetch waits (up to ``ctx.timeout_s``), a fetch that arrives
first is parked until the payload comes. Decode role: one DEALER socket per prefill server
sends fetches and receives ``[header, K bytes, V bytes]`` (or ``[header]`` with an error).
The scheduler's thread talks to the backend's thread through an inproc socket, so no zmq
socket is ever used by two threads.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import warnings
from typing import Any

import torch
import zmq

from engine.disaggregation.transfer import KvLayout, KvPayload, KvTransferBackend, KvTransferContext

logger = logging.getLogger(__name__)

_TICK_MS = 50  # how often the thread looks for expired payloads and fetches
# Frames from this size on are received as views of the message rather than copied (K and V bytes).
_VIEW_BYTES = 1 << 16


def _to_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _from_bytes(buf: bytes | memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor over the received bytes, without copying them (the tensor keeps the message
    alive; nothing writes to a payload's tensors, so the buffer being read-only does not matter)."""
    torch_dtype = getattr(torch, dtype.removeprefix("torch."))
    if not len(buf):  # an MLA pool's V (its rows hold V inside K), or an empty prompt
        return torch.empty(shape, dtype=torch_dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype).reshape(shape)


def _frames(parts: list[Any]) -> list[bytes | memoryview]:
    """Frames received without copying: small ones as bytes, KV-sized ones as views of the message."""
    return [p.bytes if len(p) < _VIEW_BYTES else p.buffer for p in parts]


def _stamped(header: bytes) -> bytes:
    """The JSON header with the time it leaves this side (``sent_unix``, wall clock)."""
    return json.dumps({**json.loads(header), "sent_unix": time.time()}).encode()


def received_meta(header: dict[str, Any]) -> dict[str, Any]:
    """The payload's ``meta`` with ``transfer_s``: seconds from the prefill side's send to now
    (wall clocks of the two machines; exact on one host)."""
    meta = dict(header.get("meta") or {})
    if "sent_unix" in header:
        meta["transfer_s"] = max(time.time() - float(header["sent_unix"]), 0.0)
    return meta


def host_pool_bytes(options: dict[str, Any] | None, plugin: str) -> int | None:
    """The ``host_pool_gb`` option in bytes (None: not given, the core's default)."""
    value = (options or {}).get("host_pool_gb")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{plugin}.host_pool_gb: invalid value {value!r}; accepted: a number of GiB >= 0 (0: no pool)")
    return int(value * (1 << 30))


class ZmqKvTransfer(KvTransferBackend):
    #: the plugin whose options these are (error messages name it).
    plugin = "kvtransfer_zmq"

    def __init__(self, ctx: KvTransferContext, options: dict[str, Any] | None = None) -> None:
        super().__init__(ctx)
        if ctx.role not in ("prefill", "decode"):
            raise ValueError(f"role: invalid value {ctx.role!r}; accepted: prefill, decode")
        self.host_pool_bytes = host_pool_bytes(options, self.plugin)
        self._zmq = zmq.Context()
        wake = f"inproc://kv-transfer-{id(self)}"
        self._commands = self._socket(zmq.PULL)
        self._commands.bind(wake)
        self._send_lock = threading.Lock()
        self._to_thread = self._socket(zmq.PUSH)
        self._to_thread.connect(wake)
        self._results: queue.Queue[tuple[str, KvPayload | str]] = queue.Queue()
        self._counts = {"published": 0, "served": 0, "fetched": 0, "failed": 0, "expired": 0, "cancelled": 0,
                        "bytes_sent": 0, "bytes_received": 0}
        self.port = ctx.port
        self._router: Any = None
        if ctx.role == "prefill":
            self._router = self._socket(zmq.ROUTER)
            address = f"tcp://{ctx.host}"
            try:
                if ctx.port:
                    self._router.bind(f"{address}:{ctx.port}")
                else:
                    self.port = self._router.bind_to_random_port(address)
            except zmq.ZMQError as exc:
                self.close()
                raise OSError(f"--disaggregation-bootstrap-port: cannot listen on {ctx.host}:{ctx.port} ({exc})") from None
        self._stopped = False
        # Decode: key -> ((host, port), deadline) of each fetch under way; the backend's thread and
        # subclasses' data-path threads end fetches through ``_finish_fetch``.
        self._pending: dict[str, tuple[tuple[str, int], float]] = {}
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"kv-transfer-{ctx.role}", daemon=True)
        self._thread.start()

    def _socket(self, kind: int) -> Any:
        sock = self._zmq.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def _command(self, *frames: Any) -> None:
        # Not copied: a payload's K and V bytes reach the backend's thread as views of the
        # scheduler's tensors (a copy here would cost the scheduler's thread ~0.1 s per 448 MiB).
        with self._send_lock:
            self._to_thread.send_multipart(list(frames), copy=False)

    # -- the scheduler's side -------------------------------------------------------------
    def publish(self, key: str, payload: KvPayload) -> None:
        self._command(b"publish", key.encode(), *self._payload_frames(key, payload))

    def _payload_frames(self, key: str, payload: KvPayload) -> list[Any]:
        """The frames a fetch of ``key`` is answered with: a JSON header, then K and V bytes.
        Subclasses with another data path send the header alone (scheduler's thread)."""
        header = {"key": key, "first_token": payload.first_token, "k_shape": list(payload.k.shape),
                  "v_shape": list(payload.v.shape), "dtype": str(payload.k.dtype), "meta": payload.meta}
        return [json.dumps(header).encode(), _to_bytes(payload.k), _to_bytes(payload.v)]

    def discard(self, key: str) -> None:
        self._command(b"discard", key.encode())

    def fetch(self, key: str, host: str, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._command(b"fetch", key.encode(), json.dumps([host, int(port), deadline]).encode())

    def cancel(self, key: str) -> None:
        self._command(b"cancel", key.encode())

    def poll(self, wait_s: float = 0.0) -> list[tuple[str, KvPayload | str]]:
        out: list[tuple[str, KvPayload | str]] = []
        try:
            out.append(self._results.get(timeout=wait_s) if wait_s > 0 else self._results.get_nowait())
            while True:
                out.append(self._results.get_nowait())
        except queue.Empty:
            pass
        return out

    def stats(self) -> dict[str, Any]:
        return {"backend": "zmq", "port": self.port, **self._counts}

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if getattr(self, "_thread", None) is not None and not self._stopped:
            self._command(b"stop")
            self._thread.join(5)
        self._zmq.destroy(linger=0)

    # -- the backend's thread -------------------------------------------------------------
    def _run(self) -> None:
        self._ready: dict[str, tuple[list[Any], float]] = {}  # prefill: key -> (frames, expires)
        # Prefill: keys whose fetch the decode side cancelled before they were published -> until
        # when to remember them; their payloads are let go as they are published, not held.
        self._cancelled: dict[str, float] = {}
        self._parked: dict[str, list[tuple[bytes, float]]] = {}  # prefill: key -> [(peer, expires)]
        self._dealers: dict[tuple[str, int], Any] = {}
        # Decode: each dealer's monitor, so a prefill server that goes away fails its fetches at once.
        self._monitors: dict[Any, tuple[str, int]] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._commands, zmq.POLLIN)
        if self._router is not None:
            self._poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stopped:
                events = dict(self._poller.poll(_TICK_MS))
                if self._commands in events:
                    self._drain(self._commands, self._on_command)
                if self._router is not None and self._router in events:
                    self._drain(self._router, self._on_fetch_request)
                for address, dealer in list(self._dealers.items()):
                    if dealer in events:
                        self._drain(dealer, lambda frames, address=address: self._reply(frames, address))
                for monitor, address in list(self._monitors.items()):
                    if monitor in events:
                        self._on_monitor(monitor, address)
                self._expire(time.monotonic())
        except Exception:  # the scheduler's fetches then time out with a message; log the cause
            logger.exception("KV transfer thread failed")
        finally:
            self._stopped = True

    @staticmethod
    def _drain(sock: Any, handle: Any) -> None:
        while True:
            try:
                frames = _frames(sock.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return
            handle(frames)

    def _on_command(self, frames: list[bytes]) -> None:
        op = frames[0]
        if op == b"stop":
            self._stopped = True
        elif op == b"publish":
            key = frames[1].decode()
            self._counts["published"] += 1
            parked = self._parked.pop(key, [])
            if self._cancelled.pop(key, None) is not None:  # its request is gone on the decode side
                self._counts["cancelled"] += 1
                self._dropped(key)
            elif parked:
                self._serve(parked[0][0], key, frames[2:])
            else:
                self._ready[key] = (frames[2:], time.monotonic() + self.ctx.timeout_s)
        elif op == b"discard":
            if self._ready.pop(frames[1].decode(), None) is not None:
                self._dropped(frames[1].decode())
        elif op == b"fetch":
            key = frames[1].decode()
            host, port, deadline = json.loads(frames[2])
            with self._pending_lock:
                self._pending[key] = ((host, port), deadline)
            request = {"op": "fetch", "key": key, "layout": self.ctx.layout.to_dict(), "backend": self.ctx.backend,
                       "timeout_s": max(deadline - time.monotonic(), 0.0), **self._handshake()}
            self._dealer(host, port).send(json.dumps(request).encode())
        elif op == b"cancel":
            key = frames[1].decode()
            with self._pending_lock:
                entry = self._pending.pop(key, None)
            if entry is not None:
                self._dealer(*entry[0]).send(json.dumps({"op": "discard", "key": key}).encode())

    def _dealer(self, host: str, port: int) -> Any:
        dealer = self._dealers.get((host, port))
        if dealer is None:
            dealer = self._socket(zmq.DEALER)
            dealer.connect(f"tcp://{host}:{port}")
            self._poller.register(dealer, zmq.POLLIN)
            self._dealers[(host, port)] = dealer
            monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._poller.register(monitor, zmq.POLLIN)
            self._monitors[monitor] = (host, port)
        return dealer

    def _on_monitor(self, monitor: Any, address: tuple[str, int]) -> None:
        """A prefill server's connection closed: its fetches under way cannot be answered (it
        keeps payloads in memory only), so they fail now rather than at their deadlines."""
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            with self._pending_lock:
                lost = [key for key, (where, _) in self._pending.items() if where == address]
            for key in lost:
                self._finish_fetch(key, f"the prefill server's transfer port {address[0]}:{address[1]} closed the "
                                        "connection (the prefill server stopped?)")

    def _handshake(self) -> dict[str, Any]:
        """Decode side: fields added to each fetch request (a subclass's data path's needs)."""
        return {}

    def _refusal(self, body: dict[str, Any]) -> str | None:
        """Prefill side: why the sender of fetch request ``body`` cannot be served (None: it can)."""
        return None

    def _dropped(self, key: str) -> None:
        """A published payload nobody will fetch was let go (subclasses free what they kept)."""

    def _serve(self, peer: bytes, key: str, frames: list[Any]) -> None:
        self._router.send_multipart([peer, _stamped(frames[0]), *frames[1:]], copy=False)
        self._counts["served"] += 1
        self._counts["bytes_sent"] += sum(len(f) for f in frames[1:])

    def _on_fetch_request(self, frames: list[bytes]) -> None:
        peer, body = frames[0], json.loads(frames[-1])
        key = body.get("key", "")
        if body.get("op") == "discard":
            self._parked.pop(key, None)
            self._let_go(key)
            return
        theirs = KvLayout.from_dict(body.get("layout", {}))
        why = self.ctx.layout.mismatch(theirs)
        error = self._refusal(body)
        if why is not None:
            error = (f"KV layouts differ between the prefill server ({self.ctx.host}:{self.port}) and this decode "
                     f"server: {why} (decode vs prefill); both need the same model, --tp-size and --kv-cache-dtype")
        backend = body.get("backend") or ""
        if backend and self.ctx.backend and backend != self.ctx.backend:  # their data paths do not meet
            error = (f"KV transfer backends differ: the prefill server ({self.ctx.host}:{self.port}) uses "
                     f"'{self.ctx.backend}', this decode server '{backend}'; start both with the same "
                     "--disaggregation-transfer-backend")
        if error is not None:
            self._router.send_multipart([peer, json.dumps({"key": key, "error": error}).encode()])
            self._let_go(key)
            return
        ready = self._ready.pop(key, None)
        if ready is not None:
            self._serve(peer, key, ready[0])
        else:
            wait = min(float(body.get("timeout_s", self.ctx.timeout_s)), self.ctx.timeout_s)
            self._parked.setdefault(key, []).append((peer, time.monotonic() + wait))

    def _let_go(self, key: str) -> None:
        """Prefill side: nobody will fetch ``key`` (its fetch was cancelled or refused): its
        payload goes now, or as it is published if it has not been yet."""
        if self._ready.pop(key, None) is not None:
            self._counts["cancelled"] += 1
            self._dropped(key)
        else:
            self._cancelled[key] = time.monotonic() + self.ctx.timeout_s

    def _finish_fetch(self, key: str, result: KvPayload | str) -> bool:
        """Ends a fetch with its payload or error (False: it was cancelled or timed out already)."""
        with self._pending_lock:
            if self._pending.pop(key, None) is None:
                return False
        if isinstance(result, str):
            self._counts["failed"] += 1
        else:
            self._counts["fetched"] += 1
            self._counts["bytes_received"] += result.nbytes
        self._results.put((key, result))
        return True

    def _reply(self, frames: list[Any], address: tuple[str, int]) -> None:
        """``_on_reply``, where an answer this side cannot read fails its own fetch, not the
        thread that serves every fetch."""
        try:
            self._on_reply(frames, address)
        except Exception as exc:  # noqa: BLE001 - e.g. a peer of another backend or version
            try:
                key = str(json.loads(bytes(frames[0])).get("key", ""))
            except (ValueError, AttributeError):
                key = ""
            logger.warning("KV transfer: an unreadable answer from %s:%s for %r: %s: %s", *address, key,
                           type(exc).__name__, exc)
            self._finish_fetch(key, f"the prefill server's transfer port {address[0]}:{address[1]} sent an answer "
                                    f"this decode server cannot read ({type(exc).__name__}: {exc}); are both started "
                                    "with the same --disaggregation-transfer-backend and version?")

    def _on_reply(self, frames: list[bytes], address: tuple[str, int]) -> None:
        header = json.loads(frames[0])
        key = header.get("key", "")
        if "error" in header:
            self._finish_fetch(key, header["error"])
            return
        k = _from_bytes(frames[1], header["dtype"], header["k_shape"])
        v = _from_bytes(frames[2], header["dtype"], header["v_shape"])
        self._finish_fetch(key, KvPayload(int(header["first_token"]), k, v, received_meta(header)))

    def _expire(self, now: float) -> None:
        for key in [k for k, until in self._cancelled.items() if until <= now]:
            del self._cancelled[key]
        for key in [k for k, (_, expires) in self._ready.items() if expires <= now]:
            del self._ready[key]
            self._dropped(key)
            self._counts["expired"] += 1
        for key, peers in list(self._parked.items()):
            for peer, expires in [p for p in peers if p[1] <= now]:
                error = (f"the prefill server ({self.ctx.host}:{self.port}) produced no KV for this request "
                         "before the decode server's deadline for it (at most --disaggregation-timeout-s, "
                         f"{self.ctx.timeout_s:g} s)")
                self._router.send_multipart([peer, json.dumps({"key": key, "error": error}).encode()])
                peers.remove((peer, expires))
            if not peers:  # every fetch of it has its error: its payload goes as it is published
                del self._parked[key]
                self._let_go(key)
        with self._pending_lock:
            late = [(key, address) for key, (address, deadline) in self._pending.items() if deadline <= now]
        for key, (host, port) in late:
            if self._finish_fetch(key, f"no KV arrived from the prefill server's transfer port {host}:{port} in "
                                       "time (--disaggregation-timeout-s); is the prefill server up?"):
                self._dealer(host, port).send(json.dumps({"op": "discard", "key": key}).encode())
