"""KV transfer plugins ``torch`` (prefill/decode disaggregation over torch.distributed
point-to-point: gloo on CPU, NCCL on CUDA) and ``cuda_ipc`` (GPU memory shared through CUDA
IPC between two servers on one machine); docs/disaggregation.md."""

from __future__ import annotations

from collections.abc import Callable

from engine_kvtransfer_zmq import HOST_POOL_GB, HOST_POOL_HELP

from engine.hookspecs import KvTransferSpec, PluginOption, hookimpl

PLUGIN = "kvtransfer_torch"


@hookimpl
def register_kv_transfer_backends(register: Callable[[KvTransferSpec], None]) -> None:
    register(KvTransferSpec(
        name="torch", factory="engine_kvtransfer_torch.backend:TorchKvTransfer", device_types=("cpu", "cuda"),
        description="torch.distributed send/recv between the two servers' ranks: gloo on CPU, NCCL on CUDA"))
    register(KvTransferSpec(
        name="cuda_ipc", factory="engine_kvtransfer_torch.ipc:CudaIpcKvTransfer", device_types=("cuda",),
        description="CUDA IPC between two servers on one machine: the decode server copies K and V out of the "
                    "prefill server's GPU memory, device to device"))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption(PLUGIN, "process_group", "auto",
                          "auto (NCCL for CUDA pools, gloo for CPU pools), nccl or gloo; gloo on CUDA pools stages "
                          "the KV in host memory and serves a prefill/decode pair on one GPU, which NCCL refuses"))
    register(PluginOption(PLUGIN, "host_pool_gb", HOST_POOL_GB, HOST_POOL_HELP + " (process_group gloo on a GPU)"))
