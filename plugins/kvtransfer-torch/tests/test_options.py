"""``kvtransfer_torch.process_group`` and ``host_pool_gb``: their values, and the refusals naming the option."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import engine_kvtransfer_torch
import engine_kvtransfer_zmq
import pytest
from engine_kvtransfer_torch.backend import TorchKvTransfer

from engine.disaggregation import KvLayout, KvTransferContext
from engine.disaggregation.transfer import HOST_POOL_BYTES

_LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, v_head_dim=8, dtype="torch.float32")


def _ctx() -> KvTransferContext:
    return KvTransferContext(role="decode", layout=_LAYOUT, timeout_s=5.0, device="cpu")


@pytest.mark.parametrize(("value", "needle"), [
    ("mpi", "kvtransfer_torch.process_group: invalid value 'mpi'; accepted: auto, nccl, gloo"),
    ("nccl", "kvtransfer_torch.process_group: 'nccl' needs a CUDA KV pool, this one is on cpu"),
])
def test_bad_process_groups_are_refused_naming_the_option(value: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        TorchKvTransfer(_ctx(), options={"process_group": value})


@pytest.mark.parametrize("value", ["auto", "gloo"])
def test_a_cpu_pool_uses_gloo(value: str) -> None:
    backend = TorchKvTransfer(_ctx(), options={"process_group": value})
    try:
        assert backend.stats()["process_group"] == "gloo" and backend.payload_device == "cpu"
    finally:
        backend.close()


@pytest.mark.parametrize(("value", "pool"), [(None, None), (0, 0), (0.5, 1 << 29), (3, 3 << 30)])
def test_host_pool_gb_sizes_the_prefill_sides_pinned_pool(value: float | None, pool: int | None) -> None:
    backend = TorchKvTransfer(_ctx(), options={} if value is None else {"host_pool_gb": value})
    try:
        assert backend.host_pool_bytes == pool  # None: the core's default
    finally:
        backend.close()


@pytest.mark.parametrize("value", [-1, True, "2"])
def test_a_bad_host_pool_gb_is_refused_naming_the_option(value: object) -> None:
    with pytest.raises(ValueError, match=f"kvtransfer_torch.host_pool_gb: invalid value {value!r}; accepted: a number"):
        TorchKvTransfer(_ctx(), options={"host_pool_gb": value})


def _refusal(prefill_as: Callable[[TorchKvTransfer], None], decode_as: Callable[[TorchKvTransfer], None]) -> str:
    """The error a decode server gets fetching from a prefill server, each set up by its
    ``*_as`` first (no GPU here: the handshake alone runs)."""
    import time

    import torch

    from engine.disaggregation import KvPayload

    prefill = TorchKvTransfer(KvTransferContext(role="prefill", layout=_LAYOUT, port=0, timeout_s=5.0))
    decode = TorchKvTransfer(_ctx())
    try:
        prefill_as(prefill)
        decode_as(decode)
        k = torch.zeros(2, 3, 2, 8)
        prefill.publish("r:1", KvPayload(5, k, k.clone(), {}))
        decode.fetch("r:1", "127.0.0.1", prefill.port, 10.0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for key, result in decode.poll(0.1):
                assert key == "r:1" and isinstance(result, str), result
                return result
        raise AssertionError("no answer within 10 s")
    finally:
        prefill.close()
        decode.close()


def _as_nccl_on_one_gpu(side: TorchKvTransfer) -> None:
    """As an NCCL rank on the GPU of UUID GPU-0f0e would be."""
    side._nccl, side._group_kind, side._gpu = True, "nccl", "GPU-0f0e"


def test_a_pair_with_different_process_groups_is_refused_naming_the_option() -> None:
    # The decode side as a decode server started with process_group=nccl on a GPU says.
    error = _refusal(lambda prefill: None, lambda decode: setattr(decode, "_group_kind", "nccl"))
    assert "over gloo, this decode server over nccl" in error and "kvtransfer_torch.process_group" in error


def test_nccl_servers_sharing_a_gpu_are_told_to_use_gloo() -> None:
    error = _refusal(_as_nccl_on_one_gpu, _as_nccl_on_one_gpu)
    assert "share one GPU" in error and "process_group=gloo" in error


def test_both_plugins_default_host_pool_gb_to_the_cores_pool_size() -> None:
    options: list[Any] = []
    for plugin in (engine_kvtransfer_zmq, engine_kvtransfer_torch):
        plugin.register_plugin_options(options.append)
    defaults = {o.plugin: o.default for o in options if o.key == "host_pool_gb"}
    assert defaults == {"kvtransfer_zmq": HOST_POOL_BYTES / (1 << 30), "kvtransfer_torch": HOST_POOL_BYTES / (1 << 30)}
