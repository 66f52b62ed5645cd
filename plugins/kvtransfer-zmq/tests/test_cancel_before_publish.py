"""A fetch the decode side cancels (its request was aborted, or its deadline passed) before the
prefill side has published the payload: the payload is let go as it is published, not held until
``timeout_s`` (on a GPU prefill server it would hold the pinned pool meanwhile)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq
from engine_kvtransfer_zmq.backend import ZmqKvTransfer
from torch.multiprocessing.reductions import StorageWeakRef

from engine.disaggregation import KvLayout, KvPayload, KvTransferContext
from engine.testing.conformance.kv_transfer import wait_for

_LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, v_head_dim=8, dtype="torch.float32")


def _wait(cond: Callable[[], bool], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def _torch_backend(ctx: KvTransferContext) -> Any:
    """The torch backend (a subclass whose payloads wait in a stash of its own), where installed."""
    backend = pytest.importorskip("engine_kvtransfer_torch.backend")
    return backend.TorchKvTransfer(ctx, options={})


def _published_and_let_go(prefill: Any, key: str, why: str) -> None:
    """Publishes a payload of ``key`` on ``prefill``: it is let go at once (counted 'cancelled'),
    its storage freed, since nobody will fetch it (``why``)."""
    k = torch.randn(2, 3, 2, 8)
    held = StorageWeakRef(k.untyped_storage())
    prefill.publish(key, KvPayload(1, k, k.clone()))
    del k
    assert _wait(lambda: prefill.stats()["cancelled"] == 1)
    assert _wait(held.expired), f"the prefill side holds a payload whose fetch {why}"


@pytest.mark.parametrize("make", [ZmqKvTransfer, _torch_backend], ids=["zmq", "torch"])
def test_a_payload_published_after_its_fetch_was_cancelled_is_let_go_at_once(make: Any) -> None:
    prefill = make(KvTransferContext(role="prefill", layout=_LAYOUT, port=0, timeout_s=30.0))
    decode = make(KvTransferContext(role="decode", layout=_LAYOUT, timeout_s=30.0))
    try:
        decode.fetch("a", "127.0.0.1", prefill.port, 20.0)
        assert _wait(lambda: "a" in prefill._parked), "the fetch did not reach the prefill side"
        decode.cancel("a")
        assert _wait(lambda: "a" not in prefill._parked), "the cancel did not reach the prefill side"
        _published_and_let_go(prefill, "a", "was cancelled")
        assert decode.poll(0.2) == []  # a cancelled fetch gives no result
        # The key is forgotten once used: a later payload of another key is served as usual.
        k2 = torch.randn(2, 3, 2, 8)
        prefill.publish("b", KvPayload(2, k2, k2.clone()))
        decode.fetch("b", "127.0.0.1", prefill.port, 10.0)
        assert torch.equal(wait_for(decode, "b").k, k2)
    finally:
        decode.close()
        prefill.close()


def test_a_payload_published_after_its_fetch_was_refused_is_let_go_at_once() -> None:
    """A fetch refused at the handshake (here: layouts differ) before the payload is published."""
    prefill = ZmqKvTransfer(KvTransferContext(role="prefill", layout=_LAYOUT, port=0, timeout_s=30.0))
    other = KvLayout(num_layers=2, num_kv_heads=4, head_dim=8, v_head_dim=8, dtype="torch.float32")
    decode = ZmqKvTransfer(KvTransferContext(role="decode", layout=other, timeout_s=30.0))
    try:
        decode.fetch("a", "127.0.0.1", prefill.port, 20.0)
        assert "KV layouts differ" in wait_for(decode, "a")
        _published_and_let_go(prefill, "a", "was refused")
    finally:
        decode.close()
        prefill.close()


def test_a_payload_published_after_its_parked_fetch_expired_is_let_go_at_once() -> None:
    """A fetch parked on the prefill side past its wait is answered with an error: nobody fetches
    that key any more, so its payload is let go as it is published. (The decode side is a bare
    socket asking for a 0.2 s wait, which sends no discard of its own afterwards.)"""
    prefill = ZmqKvTransfer(KvTransferContext(role="prefill", layout=_LAYOUT, port=0, timeout_s=30.0))
    context = zmq.Context()
    decode = context.socket(zmq.DEALER)
    decode.setsockopt(zmq.LINGER, 0)
    try:
        decode.connect(f"tcp://127.0.0.1:{prefill.port}")
        decode.send(json.dumps({"op": "fetch", "key": "a", "layout": _LAYOUT.to_dict(), "timeout_s": 0.2}).encode())
        assert decode.poll(10_000), "the parked fetch got no answer"
        assert "produced no KV for this request" in json.loads(decode.recv())["error"]
        _published_and_let_go(prefill, "a", "expired while parked")
    finally:
        context.destroy(linger=0)
        prefill.close()
