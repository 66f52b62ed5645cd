"""``CudaIpcKvTransfer``: the zmq backend's handshake, with K and V read straight from the
prefill server's GPU memory through CUDA IPC (both servers on one machine).

The prefill side keeps a payload on its device and answers a fetch with the IPC handles of K's
and V's memory (``UntypedStorage._share_cuda_``: the allocation's handle, the offsets, and an
IPC event recorded behind the gather that filled them). The decode side opens the handles, waits
for that event on a stream of its own, copies K and V into tensors of its own device (one
device-to-device copy each; across GPUs over peer access), and tells the prefill side to let
its copy go. Nothing crosses host memory or a socket but the JSON header.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import time
from typing import Any

import torch
from engine_kvtransfer_zmq.backend import ZmqKvTransfer, received_meta

from engine.disaggregation.transfer import KvPayload, KvTransferContext

logger = logging.getLogger(__name__)


def host_id() -> str:
    """Names this machine's boot: two processes can share GPU memory only when these agree."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}/{f.read().strip()}"
    except OSError:
        return socket.gethostname()


def share(t: torch.Tensor) -> dict[str, Any] | None:
    """What another process needs to open ``t``'s memory (JSON-able); None for an empty tensor."""
    if t.numel() == 0:
        return None
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = t.untyped_storage()._share_cuda_()
    b64 = lambda b: None if b is None else base64.b64encode(b).decode()  # noqa: E731
    return {"device": int(device), "handle": b64(handle), "size": int(size), "offset": int(offset),
            "ref_handle": b64(ref_handle), "ref_offset": int(ref_offset), "event_handle": b64(event_handle),
            "event_sync": bool(event_sync), "storage_offset": t.storage_offset(), "shape": list(t.shape),
            "stride": list(t.stride())}


def open_shared(desc: dict[str, Any] | None, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The other process's tensor that ``share`` described (its memory, mapped here); the
    current stream waits for the event recorded where it was shared."""
    if desc is None:
        return torch.empty(shape, dtype=dtype)
    raw = lambda s: None if s is None else base64.b64decode(s)  # noqa: E731
    torch.cuda.init()  # opening a handle needs this process's CUDA state (a no-op once a server runs)
    storage = torch.UntypedStorage._new_shared_cuda(
        desc["device"], raw(desc["handle"]), desc["size"], desc["offset"], raw(desc["ref_handle"]),
        desc["ref_offset"], raw(desc["event_handle"]), desc["event_sync"])
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    return torch.empty((0,), dtype=dtype, device=storage.device).set_(
        typed, desc["storage_offset"], desc["shape"], desc["stride"])


class CudaIpcKvTransfer(ZmqKvTransfer):
    plugin = "kvtransfer_torch"  # its payloads stay on the device: ``host_pool_gb`` is not used

    def __init__(self, ctx: KvTransferContext, options: dict[str, Any] | None = None) -> None:
        self._device = torch.device(ctx.device)
        if self._device.type != "cuda":
            raise ValueError(f"--disaggregation-transfer-backend cuda_ipc: needs a CUDA KV pool, this one is on "
                             f"{ctx.device}; accepted here: zmq, torch")
        #: where the scheduler leaves payloads it publishes (the mixin reads it): on the device.
        self.payload_device = str(self._device)
        self._host = host_id()
        # Prefill: key -> (K, V, expires) of payloads served and not yet copied by the decode side.
        self._lent: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self._lent_lock = threading.Lock()
        self._stream: Any = None  # decode: the backend thread's copy stream (made there)
        super().__init__(ctx, options)
        self._counts.update({"ipc_bytes": 0, "copy_s": 0.0})

    # -- handshake ---------------------------------------------------------------------
    def _handshake(self) -> dict[str, Any]:
        return {"ipc_host": self._host}

    def _refusal(self, body: dict[str, Any]) -> str | None:
        if body.get("ipc_host") != self._host:
            return ("cuda_ipc KV transfer: the decode server runs on another machine (or without cuda_ipc), and CUDA "
                    "IPC shares GPU memory within one machine only; use --disaggregation-transfer-backend torch or zmq "
                    "on both servers")
        return None

    # -- prefill side (publish runs on the scheduler's thread, behind the gather) --------
    def _payload_frames(self, key: str, payload: KvPayload) -> list[Any]:
        k, v = payload.k.contiguous(), payload.v.contiguous()
        header = {"key": key, "first_token": payload.first_token, "k_shape": list(k.shape), "v_shape": list(v.shape),
                  "dtype": str(k.dtype), "meta": payload.meta, "ipc": {"k": share(k), "v": share(v)}}
        with self._lent_lock:
            self._lent[key] = (k, v, time.monotonic() + self.ctx.timeout_s)
        return [json.dumps(header).encode()]

    def _serve(self, peer: bytes, key: str, frames: list[Any]) -> None:
        super()._serve(peer, key, frames)
        with self._lent_lock:
            lent = self._lent.get(key)
        if lent is not None:
            self._counts["bytes_sent"] += lent[0].nbytes + lent[1].nbytes

    def _dropped(self, key: str) -> None:
        with self._lent_lock:
            self._lent.pop(key, None)

    def _on_fetch_request(self, frames: list[bytes]) -> None:
        body = json.loads(frames[-1])
        if body.get("op") == "release":  # the decode side has its own copy now
            self._dropped(body.get("key", ""))
            return
        super()._on_fetch_request(frames)

    def _expire(self, now: float) -> None:
        super()._expire(now)
        with self._lent_lock:
            for key in [k for k, (_, _, expires) in self._lent.items() if expires <= now]:
                del self._lent[key]

    # -- decode side (the backend's thread) ---------------------------------------------
    def _on_reply(self, frames: list[bytes], address: tuple[str, int]) -> None:
        header = json.loads(frames[0])
        if "ipc" not in header:
            super()._on_reply(frames, address)
            return
        key = header["key"]
        try:
            k, v, took = self._copy_in(header)
        except Exception as exc:  # noqa: BLE001 - a handle that does not open fails this fetch
            self._finish_fetch(key, f"cuda_ipc KV transfer: opening the prefill server's GPU memory failed "
                                    f"({type(exc).__name__}: {exc})")
        else:
            self._counts["ipc_bytes"] += k.nbytes + v.nbytes
            self._counts["copy_s"] += took
            self._finish_fetch(key, KvPayload(int(header["first_token"]), k, v, received_meta(header)))
        self._dealer(*address).send(json.dumps({"op": "release", "key": key}).encode())

    def _copy_in(self, header: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, float]:
        started = time.perf_counter()
        if self._stream is None:
            torch.cuda.set_device(self._device)
            self._stream = torch.cuda.Stream(self._device)
        dtype = getattr(torch, header["dtype"].removeprefix("torch."))
        with torch.cuda.stream(self._stream):
            theirs_k = open_shared(header["ipc"]["k"], dtype, header["k_shape"])
            theirs_v = open_shared(header["ipc"]["v"], dtype, header["v_shape"])
            k = theirs_k.to(self._device, copy=True)
            v = theirs_v.to(self._device, copy=True)
        self._stream.synchronize()  # their memory may go once this returns
        del theirs_k, theirs_v
        return k, v, time.perf_counter() - started

    def close(self) -> None:
        super().close()
        with self._lent_lock:
            self._lent.clear()  # the prefill side's device copies of payloads served

    def stats(self) -> dict[str, Any]:
        with self._lent_lock:
            lent = len(self._lent)
        return {**super().stats(), "backend": "cuda_ipc", "lent": lent}
