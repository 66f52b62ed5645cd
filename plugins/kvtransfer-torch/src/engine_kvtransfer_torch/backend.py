"""``TorchKvTransfer``: the zmq backend's handshake, with K and V sent over torch.distributed.

Each prefill/decode pair of ranks shares a process group of two (rank 0 the prefill side),
made on the pair's first transfer through the prefill side's TCPStore (its port travels in the
fetch answer's header). A pair's transfers run in order on one thread per side, so sends and
receives match without tags. Gloo moves host tensors; NCCL (CUDA pools) moves device tensors
directly, so the prefill side keeps the payload on its device (``payload_device``).
"""

from __future__ import annotations

import datetime
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from engine_kvtransfer_zmq.backend import ZmqKvTransfer, received_meta

from engine.disaggregation.transfer import KvPayload, KvTransferContext

logger = logging.getLogger(__name__)

_GROUPS = ("auto", "nccl", "gloo")
Job = tuple[Callable[[Any], None], Callable[[str], None]]  # (run with the group, fail with a reason)


class _Pair:
    """One prefill/decode pair: its process group (made on first use) and its ordered jobs."""

    def __init__(self, name: str, make_group: Callable[[], Any]) -> None:
        self.name = name
        self.broken: str | None = None
        self._make_group = make_group
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"kv-pair-{name[:8]}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """Ends the pair's thread after its queued jobs (a blocked transfer ends by its time-out)."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        group = None
        while (job := self._jobs.get()) is not None:
            run, fail = job
            if self.broken is not None:
                fail(self.broken)
                continue
            try:
                if group is None:
                    group = self._make_group()
                run(group)
            except Exception as exc:  # noqa: BLE001 - a dead peer or a time-out: this pair is done
                self.broken = f"{type(exc).__name__}: {exc}"
                logger.warning("KV transfer pair %s failed: %s", self.name, self.broken)
                fail(self.broken)
        # The group's own threads end here, in this thread, while the interpreter still runs.
        del group


class TorchKvTransfer(ZmqKvTransfer):
    plugin = "kvtransfer_torch"

    def __init__(self, ctx: KvTransferContext, options: dict[str, Any] | None = None) -> None:
        self._device = torch.device(ctx.device)
        group = str((options or {}).get("process_group", "auto"))
        if group not in _GROUPS:
            raise ValueError(f"kvtransfer_torch.process_group: invalid value {group!r}; accepted: {', '.join(_GROUPS)}")
        if group == "nccl" and self._device.type != "cuda":
            raise ValueError(f"kvtransfer_torch.process_group: 'nccl' needs a CUDA KV pool, this one is on {ctx.device}; "
                             "accepted here: auto, gloo")
        self._nccl = self._device.type == "cuda" and group != "gloo"
        self._group_kind = "nccl" if self._nccl else "gloo"
        # The GPU's UUID: NCCL cannot pair two ranks on one GPU, which the handshake then says.
        uuid = getattr(torch.cuda.get_device_properties(self._device), "uuid", None) if self._nccl else None
        self._gpu = None if uuid is None else str(uuid)
        #: where the scheduler leaves payloads it publishes (the mixin reads it).
        self.payload_device = str(self._device) if self._nccl else "cpu"
        self._op_timeout = datetime.timedelta(seconds=ctx.timeout_s)
        self._stash: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stash_lock = threading.Lock()
        self._pairs: dict[Any, _Pair] = {}
        self._store: Any = None
        self._store_port = 0
        if ctx.role == "prefill":
            self._store = dist.TCPStore(ctx.host, 0, is_master=True, wait_for_workers=False, timeout=self._op_timeout)
            self._store_port = self._store.port
        super().__init__(ctx, options)

    def _group(self, store: Any, name: str, rank: int) -> Any:
        prefixed = dist.PrefixStore(f"kv-pair/{name}", store)
        if self._nccl:
            torch.cuda.set_device(self._device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self._op_timeout
            return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
        return dist.ProcessGroupGloo(prefixed, rank, 2, self._op_timeout)

    # -- handshake ---------------------------------------------------------------------
    def _handshake(self) -> dict[str, Any]:
        return {"process_group": self._group_kind, "gpu": self._gpu}

    def _refusal(self, body: dict[str, Any]) -> str | None:
        theirs = body.get("process_group")
        if theirs is not None and theirs != self._group_kind:
            return (f"torch KV transfer: the prefill server moves KV over {self._group_kind}, this decode server over "
                    f"{theirs}; give both the same --plugin-option kvtransfer_torch.process_group")
        if self._nccl and self._gpu is not None and body.get("gpu") == self._gpu:
            return ("torch KV transfer: the prefill and decode servers share one GPU, which NCCL cannot pair; start "
                    "both with --plugin-option kvtransfer_torch.process_group=gloo")
        return None

    # -- prefill side ------------------------------------------------------------------
    def _payload_frames(self, key: str, payload: KvPayload) -> list[Any]:
        with self._stash_lock:
            self._stash[key] = (payload.k.contiguous(), payload.v.contiguous())
        header = {"key": key, "first_token": payload.first_token, "k_shape": list(payload.k.shape),
                  "v_shape": list(payload.v.shape), "dtype": str(payload.k.dtype), "meta": payload.meta}
        return [json.dumps(header).encode()]

    def _dropped(self, key: str) -> None:
        with self._stash_lock:
            self._stash.pop(key, None)

    def _serve(self, peer: bytes, key: str, frames: list[Any]) -> None:
        with self._stash_lock:
            tensors = self._stash.pop(key, None)
        pair = self._pairs.get(peer)
        if tensors is None or (pair is not None and pair.broken is not None):
            why = "its payload was dropped" if tensors is None else f"the pair's process group failed ({pair.broken})"  # type: ignore[union-attr]
            self._router.send_multipart([peer, json.dumps({"key": key, "error": f"torch KV transfer: {why}"}).encode()])
            if pair is not None and pair.broken is not None:
                pair.stop()
                del self._pairs[peer]
            return
        if pair is None:
            name = f"{self._store_port}-{peer.hex()}"
            pair = self._pairs[peer] = _Pair(name, lambda name=name: self._group(self._store, name, 0))
        header = {**json.loads(frames[0]), "pair": pair.name, "store_port": self._store_port, "sent_unix": time.time()}
        self._router.send_multipart([peer, json.dumps(header).encode()])
        k, v = tensors

        def send(group: Any) -> None:
            group.send([k], 1, 0).wait()
            if v.numel():
                group.send([v], 1, 0).wait()

        pair.submit((send, lambda why: None))
        self._counts["served"] += 1
        self._counts["bytes_sent"] += k.numel() * k.element_size() + v.numel() * v.element_size()

    # -- decode side -------------------------------------------------------------------
    def _on_reply(self, frames: list[bytes], address: tuple[str, int]) -> None:
        header = json.loads(frames[0])
        if "pair" not in header:
            super()._on_reply(frames, address)
            return
        key, host = header["key"], address[0]
        slot = (host, int(header["store_port"]), header["pair"])
        pair = self._pairs.get(slot)
        if pair is None:
            pair = self._pairs[slot] = _Pair(header["pair"], lambda: self._group(
                dist.TCPStore(host, slot[1], is_master=False, timeout=self._op_timeout), slot[2], 1))
        dtype = getattr(torch, header["dtype"].removeprefix("torch."))
        device = self._device if self._nccl else torch.device("cpu")
        # gloo for a CUDA pool: receive into pinned memory, which the pool's device copies from fastest.
        pin = not self._nccl and self._device.type == "cuda"

        def receive(group: Any) -> None:
            # Received even when the fetch was cancelled meanwhile: the pair's stream stays in step.
            k = torch.empty(header["k_shape"], dtype=dtype, device=device, pin_memory=pin)
            v = torch.empty(header["v_shape"], dtype=dtype, device=device, pin_memory=pin)
            group.recv([k], 0, 0).wait()
            if v.numel():
                group.recv([v], 0, 0).wait()
            if self._nccl:
                torch.cuda.current_stream(device).synchronize()
            self._finish_fetch(key, KvPayload(int(header["first_token"]), k, v, received_meta(header)))

        pair.submit((receive, lambda why: self._finish_fetch(key, f"torch KV transfer from {host} failed: {why}")))

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "backend": "torch", "process_group": self._group_kind,
                "pairs": len(self._pairs)}

    def close(self) -> None:
        super().close()
        for pair in list(self._pairs.values()):
            pair.stop()
        self._pairs.clear()
        with self._stash_lock:
            self._stash.clear()
        self._store = None  # the prefill side's TCPStore server stops with it
