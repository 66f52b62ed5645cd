"""A decode server whose --disaggregation-transfer-backend differs from its prefill server's gets
a fetch error naming both at once (their data paths do not meet), and its transfer thread keeps
serving other fetches."""

from __future__ import annotations

import time

import torch
from engine_kvtransfer_torch.backend import TorchKvTransfer
from engine_kvtransfer_zmq.backend import ZmqKvTransfer

from engine.disaggregation import KvLayout, KvPayload, KvTransferContext
from engine.testing.conformance.kv_transfer import wait_for

_LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, v_head_dim=8, dtype="torch.float32")


def _ctx(role: str, backend: str) -> KvTransferContext:
    return KvTransferContext(role=role, layout=_LAYOUT, port=0, timeout_s=10.0, backend=backend)


def test_a_zmq_decode_server_fetching_from_a_torch_prefill_server_is_refused_naming_both() -> None:
    k, v = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)
    torch_prefill = TorchKvTransfer(_ctx("prefill", "torch"), options={})
    zmq_prefill = ZmqKvTransfer(_ctx("prefill", "zmq"))
    decode = ZmqKvTransfer(_ctx("decode", "zmq"))
    try:
        torch_prefill.publish("a", KvPayload(1, k, v))
        decode.fetch("a", "127.0.0.1", torch_prefill.port, 8.0)
        started = time.monotonic()
        error = wait_for(decode, "a", 8.0)
        assert time.monotonic() - started < 3, "the mismatch waited for the fetch's deadline"
        assert isinstance(error, str) and "KV transfer backends differ" in error
        assert "uses 'torch', this decode server 'zmq'" in error and "--disaggregation-transfer-backend" in error
        # The decode side's thread serves on: a fetch from a prefill server of its own backend arrives.
        zmq_prefill.publish("b", KvPayload(2, k, v))
        decode.fetch("b", "127.0.0.1", zmq_prefill.port, 8.0)
        payload = wait_for(decode, "b", 8.0)
        assert isinstance(payload, KvPayload) and torch.equal(payload.k, k) and torch.equal(payload.v, v)
    finally:
        decode.close()
        zmq_prefill.close()
        torch_prefill.close()
