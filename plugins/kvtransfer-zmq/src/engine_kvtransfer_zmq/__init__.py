"""KV transfer plugin ``zmq``: prefill/decode disaggregation over ZeroMQ/TCP (docs/disaggregation.md)."""

from __future__ import annotations

from collections.abc import Callable

from engine.hookspecs import KvTransferSpec, PluginOption, hookimpl

PLUGIN = "kvtransfer_zmq"

#: help of the ``host_pool_gb`` option (both kvtransfer plugins declare it).
HOST_POOL_HELP = ("GiB of pinned host memory a GPU prefill server takes at start-up for the KV payloads waiting "
                  "to be sent (reused once sent; a payload that finds no room waits up to 0.5 s, then takes fresh "
                  "pinned memory, which stalls kernel launches); 0: none")


@hookimpl
def register_kv_transfer_backends(register: Callable[[KvTransferSpec], None]) -> None:
    register(KvTransferSpec(
        name="zmq", factory="engine_kvtransfer_zmq.backend:ZmqKvTransfer", device_types=("cpu", "cuda"),
        description="ZeroMQ over TCP from host memory (GPU KV is staged through the host)"))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption(PLUGIN, "host_pool_gb", 2.0, HOST_POOL_HELP))
