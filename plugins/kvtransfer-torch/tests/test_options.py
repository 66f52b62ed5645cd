"""``kvtransfer_torch.process_group``: its values, and the refusals naming the option."""

from __future__ import annotations

import pytest
from engine_kvtransfer_torch.backend import TorchKvTransfer

from engine.disaggregation import KvLayout, KvTransferContext

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
