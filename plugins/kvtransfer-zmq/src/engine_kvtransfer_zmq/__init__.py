"""KV transfer plugin ``zmq``: prefill/decode disaggregation over ZeroMQ/TCP (docs/disaggregation.md)."""

from __future__ import annotations

from collections.abc import Callable

from engine.disaggregation.transfer import HOST_POOL_BYTES, HOST_POOL_WAIT_S
from engine.hookspecs import KvTransferSpec, PluginOption, hookimpl

PLUGIN = "kvtransfer_zmq"

#: default and help of the ``host_pool_gb`` option (both kvtransfer plugins declare it).
HOST_POOL_GB = HOST_POOL_BYTES / (1 << 30)
HOST_POOL_HELP = ("GiB of pinned host memory a GPU prefill server takes at start-up for the KV payloads waiting "
                  f"to be sent (reused once sent; a payload that finds no room waits up to {HOST_POOL_WAIT_S:g} s, "
                  "then takes fresh pinned memory, which stalls kernel launches); 0: none")


@hookimpl
def register_kv_transfer_backends(register: Callable[[KvTransferSpec], None]) -> None:
    register(KvTransferSpec(
        name="zmq", factory="engine_kvtransfer_zmq.backend:ZmqKvTransfer", device_types=("cpu", "cuda"),
        description="ZeroMQ over TCP from host memory (GPU KV is staged through the host)"))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption(PLUGIN, "host_pool_gb", HOST_POOL_GB, HOST_POOL_HELP))
