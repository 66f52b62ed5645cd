"""KV transfer plugin ``zmq``: prefill/decode disaggregation over ZeroMQ/TCP (docs/disaggregation.md)."""

from __future__ import annotations

from collections.abc import Callable

from engine.hookspecs import KvTransferSpec, hookimpl


@hookimpl
def register_kv_transfer_backends(register: Callable[[KvTransferSpec], None]) -> None:
    register(KvTransferSpec(
        name="zmq", factory="engine_kvtransfer_zmq.backend:ZmqKvTransfer", device_types=("cpu", "cuda"),
        description="ZeroMQ over TCP from host memory (GPU KV is staged through the host)"))
