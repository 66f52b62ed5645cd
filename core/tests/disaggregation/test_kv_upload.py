"""KvUploader: arrival order, the bound on uploaded payloads not yet written, release."""

from __future__ import annotations

import time

import pytest
import torch

from engine.disaggregation.transfer import KvPayload
from engine.disaggregation.upload import _MAX_AHEAD, KvUploader


def _payload(i: int) -> KvPayload:
    return KvPayload(i, torch.full((2, 3, 1, 4), float(i)), torch.zeros((2, 3, 1, 4)), {"n": i})


def _collect(up: KvUploader, want: int, timeout_s: float = 5.0) -> list[tuple[object, KvPayload]]:
    got: list[tuple[object, KvPayload]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += up.done(0.05)
    return got


def test_threaded_uploads_keep_order_and_stop_at_the_bound_until_released() -> None:
    up = KvUploader(None, torch.device("cpu"), threaded=True)
    try:
        for i in range(_MAX_AHEAD + 2):
            up.submit(f"r{i}", _payload(i))
        first = _collect(up, _MAX_AHEAD)
        time.sleep(0.2)  # the thread would have uploaded more by now without the bound
        assert up.done() == []
        assert [item for item, _ in first] == [f"r{i}" for i in range(_MAX_AHEAD)]
        assert all(p.first_token == int(item[1:]) and p.meta["n"] == p.first_token for item, p in first)
        assert up.busy()
        up.release(2)
        rest = _collect(up, 2)
        assert [item for item, _ in rest] == [f"r{_MAX_AHEAD}", f"r{_MAX_AHEAD + 1}"]
        assert not up.busy()
        # Payloads already on the pool's device pass through untouched.
        assert torch.equal(rest[0][1].k, _payload(_MAX_AHEAD).k)
    finally:
        up.close()


def test_inline_uploader_hands_payloads_back_at_once() -> None:
    up = KvUploader(None, torch.device("cpu"))
    p = _payload(7)
    up.submit("a", p)
    assert up.busy()
    assert up.done() == [("a", p)]
    assert not up.busy()
    up.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_uploads_to_the_gpu_on_a_side_stream() -> None:
    from engine.platforms import TorchCudaPlatform

    class _Cuda(TorchCudaPlatform):  # its streams and events; no plugin needed
        def is_available(self) -> bool:
            return True

        def default_attention_backend(self, available: object) -> str:
            return "triton"

    up = KvUploader(_Cuda(), torch.device("cuda:0"))
    try:
        sent = [_payload(i) for i in range(3)]
        for i, p in enumerate(sent):
            up.submit(i, p)
        got = _collect(up, 2)
        up.release(2)
        got += _collect(up, 1)
        assert [item for item, _ in got] == [0, 1, 2]
        for (_, p), q in zip(got, sent, strict=True):
            assert p.k.device.type == "cuda" and torch.equal(p.k.cpu(), q.k) and torch.equal(p.v.cpu(), q.v)
            assert p.meta["upload_s"] > 0
    finally:
        up.close()
