"""KV transfer plugin ``torch``: prefill/decode disaggregation over torch.distributed
point-to-point (gloo on CPU, NCCL on CUDA; docs/disaggregation.md)."""

from __future__ import annotations

from collections.abc import Callable

from engine.hookspecs import KvTransferSpec, hookimpl


@hookimpl
def register_kv_transfer_backends(register: Callable[[KvTransferSpec], None]) -> None:
    register(KvTransferSpec(
        name="torch", factory="engine_kvtransfer_torch.backend:TorchKvTransfer", device_types=("cpu", "cuda"),
        description="torch.distributed send/recv between the two servers' ranks: gloo on CPU, NCCL on CUDA"))
