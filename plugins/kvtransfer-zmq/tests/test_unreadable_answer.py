"""A prefill side's answer that the decode side cannot read (another backend's or version's frames)
fails that fetch at once with a message, and the decode side's transfer thread serves on."""

from __future__ import annotations

import json
import threading
import time

import torch
import zmq
from engine_kvtransfer_zmq.backend import ZmqKvTransfer

from engine.disaggregation import KvLayout, KvPayload, KvTransferContext
from engine.testing.conformance.kv_transfer import wait_for

_LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, v_head_dim=8, dtype="torch.float32")


def test_an_answer_without_the_kv_frames_fails_its_fetch_and_not_the_thread() -> None:
    context = zmq.Context()
    peer = context.socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    port = peer.bind_to_random_port("tcp://127.0.0.1")

    def answer_with_a_header_alone() -> None:  # the K and V frames are missing
        if peer.poll(5000):
            sender, body = peer.recv_multipart()
            header = {"key": json.loads(body)["key"], "first_token": 1, "k_shape": [2, 3, 2, 8],
                      "v_shape": [2, 3, 2, 8], "dtype": "torch.float32"}
            peer.send_multipart([sender, json.dumps(header).encode()])

    fake = threading.Thread(target=answer_with_a_header_alone, daemon=True)
    fake.start()
    decode = ZmqKvTransfer(KvTransferContext(role="decode", layout=_LAYOUT, timeout_s=10.0))
    prefill = ZmqKvTransfer(KvTransferContext(role="prefill", layout=_LAYOUT, port=0, timeout_s=10.0))
    try:
        decode.fetch("a", "127.0.0.1", port, 8.0)
        started = time.monotonic()
        error = wait_for(decode, "a", 8.0)
        assert time.monotonic() - started < 3
        assert isinstance(error, str) and f"127.0.0.1:{port} sent an answer this decode server cannot read" in error
        k, v = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)
        prefill.publish("b", KvPayload(2, k, v))
        decode.fetch("b", "127.0.0.1", prefill.port, 8.0)
        payload = wait_for(decode, "b", 8.0)
        assert isinstance(payload, KvPayload) and torch.equal(payload.k, k)
    finally:
        decode.close()
        prefill.close()
        fake.join(5)
        context.destroy(linger=0)
