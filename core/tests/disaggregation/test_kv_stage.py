"""KvStager (a prefill server's copies of prompt KV to host memory, published by a thread when
each copy's event completes) and the threads' release of what they held, with events that the
test completes by hand; the gpu test copies real KV on a CUDA copy stream."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch

from engine.disaggregation.host_pool import ALIGN
from engine.disaggregation.stage import KvStager
from engine.disaggregation.transfer import HOST_POOL_WAIT_S, KvPayload
from engine.disaggregation.upload import KvUploader


class _Event:
    """A device event the test completes: ``synchronize`` blocks until ``complete``."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.by = threading.current_thread().name
        self.waited = threading.Event()

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.waited.set()
        assert self._done.wait(10), "an event nobody completed"

    def complete(self) -> None:
        self._done.set()


class _Stream:
    def __init__(self) -> None:
        self.waited_for: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited_for.append(event)


class _Platform:
    """Streams and events without a device; the events the stager's thread makes (one per
    copy, in order) are kept in ``copies``."""

    def __init__(self) -> None:
        self.copies: list[_Event] = []
        self.stream = _Stream()

    def create_stream(self) -> _Stream:
        return self.stream

    def stream_context(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def create_event(self) -> _Event:
        event = _Event()
        if event.by == "kv-stage":
            self.copies.append(event)
        return event

    def set_device(self, device: Any) -> None:
        pass

    def pin_host_memory(self) -> bool:
        return False


def _wait(cond: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(cond())


def _kv(i: int, tokens: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((2, tokens, 1, 4), float(i)), torch.full((2, tokens, 1, 4), -float(i))


def _copying(platform: _Platform, n: int) -> _Event:
    """The stager's ``n``-th copy event (0-based), once its thread waits for it."""
    assert _wait(lambda: len(platform.copies) > n and platform.copies[n].waited.is_set())
    return platform.copies[n]


def test_payloads_are_published_in_hand_over_order_once_copied_to_host_memory() -> None:
    platform, published = _Platform(), []
    stager = KvStager(platform, torch.device("cpu"), lambda key, p: published.append((key, p)))
    try:
        copies = [stager.gathered(*_kv(i)) for i in range(2)]
        sources = [c.sources for c in copies]
        records: list[dict[str, Any]] = [{"copy_s": None}, {"copy_s": None}]
        for i, copy in enumerate(copies):
            stager.publish_after(copy, f"k{i}", KvPayload(i, *copy.sources, {"i": i}), records[i])
        first = _copying(platform, 0)
        assert platform.stream.waited_for[0] is copies[0].marker, "the copy did not wait for its gather"
        time.sleep(0.1)
        assert published == [] and stager.busy(), "published before its copy completed"
        first.complete()
        _copying(platform, 1).complete()
        assert _wait(lambda: len(published) == 2) and _wait(lambda: not stager.busy())
        assert [key for key, _ in published] == ["k0", "k1"]
        for i, (_, p) in enumerate(published):
            k, v = _kv(i)
            assert torch.equal(p.k, k) and torch.equal(p.v, v) and p.meta == {"i": i} and p.first_token == i
        assert published[0][1].k is not sources[0][0], "the device staging was published, not its host copy"
        assert all(r["copy_s"] >= 0 for r in records)
        assert all(c.sources == () for c in copies), "device staging kept after its copy"
    finally:
        stager.close()


def test_a_staging_thread_that_cannot_start_never_leaves_the_scheduler_waiting() -> None:
    class _NoDevice(_Platform):
        def set_device(self, device: Any) -> None:
            raise RuntimeError("no such device")

    k, v = _kv(1)
    stager = KvStager(_NoDevice(), torch.device("meta"), lambda key, p: None, max_bytes=k.nbytes + v.nbytes)
    try:
        assert _wait(lambda: not stager._thread.is_alive())
        done = threading.Event()

        def hand_over_twice() -> None:  # the second would wait for the first's copy under the bound
            for i in range(2):
                stager.publish_after(stager.gathered(k, v), f"k{i}", KvPayload(i, k, v))
            done.set()

        threading.Thread(target=hand_over_twice, daemon=True).start()
        assert done.wait(5), "the scheduler's thread waits on a stager without a thread"
        assert not stager.busy()
    finally:
        stager.close()


def test_the_bound_waits_for_handed_over_copies_to_end() -> None:
    platform = _Platform()
    k, v = _kv(1)
    stager = KvStager(platform, torch.device("cpu"), lambda key, p: None, max_bytes=2 * (k.nbytes + v.nbytes))
    try:
        for i in range(2):
            copy = stager.gathered(k, v)
            stager.publish_after(copy, f"k{i}", KvPayload(i, k, v))
        assert stager.waits == 0
        third: list[Any] = []
        side = threading.Thread(target=lambda: third.append(stager.gathered(k, v)))
        side.start()
        time.sleep(0.2)
        assert third == [] and stager.waits == 1, "a third copy in flight passes the bound"
        _copying(platform, 0).complete()
        side.join(5)
        assert len(third) == 1
        _copying(platform, 1).complete()
    finally:
        stager.close()


def _pool_of_two(payloads: int) -> tuple[_Platform, list[KvPayload], KvStager]:
    """A stager whose pinned pool holds two payloads, the list its publish callback fills, and
    ``payloads`` payloads handed to it (their copies not complete yet)."""
    platform, published = _Platform(), []
    stager = KvStager(platform, torch.device("cpu"), lambda key, p: published.append(p), pool_bytes=2 * ALIGN)
    for i in range(payloads):
        copy = stager.gathered(*_kv(i))
        stager.publish_after(copy, f"k{i}", KvPayload(i, *copy.sources))
    return platform, published, stager


def test_payloads_reuse_the_pool_once_let_go_and_wait_a_bounded_time_for_room() -> None:
    """The pool holds the payloads the backend has not let go: the next one waits until one goes
    and then reuses its bytes (no fresh memory), at most HOST_POOL_WAIT_S, then takes fresh memory."""
    platform, published, stager = _pool_of_two(3)
    try:
        _copying(platform, 0).complete()
        assert _wait(lambda: len(published) == 1)
        first_at = published[0].k.data_ptr()
        time.sleep(0.2)
        assert len(platform.copies) == 1 and stager.held_waits == 1, "the second copy did not wait for room"
        published.clear()  # the backend sent the first payload and let it go
        started = time.monotonic()
        _copying(platform, 1).complete()
        assert _wait(lambda: len(published) == 1) and time.monotonic() - started < HOST_POOL_WAIT_S
        assert published[0].k.data_ptr() == first_at, "the second payload did not reuse the first's bytes"
        assert torch.equal(published[0].k, _kv(1)[0]) and torch.equal(published[0].v, _kv(1)[1])
        # Nothing is let go now: the third waits HOST_POOL_WAIT_S at most, then takes fresh memory.
        started = time.monotonic()
        _copying(platform, 2).complete()
        assert _wait(lambda: len(published) == 2) and stager.held_waits == 2
        assert torch.equal(published[1].k, _kv(2)[0])
        assert stager.stats() == {"copying": 0, "pool_bytes": 2 * ALIGN, "held_bytes": 2 * ALIGN, "fresh": 1,
                                  "staging_waits": 0, "held_waits": 2}
        assert HOST_POOL_WAIT_S * 0.8 < time.monotonic() - started < HOST_POOL_WAIT_S + 3
    finally:
        stager.close()


def test_a_payload_waiting_for_room_when_the_stager_closes_takes_no_fresh_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing the stager (the server stops) while a payload waits for the pool ends the wait:
    the payload is dropped like the queued ones, without fresh pinned memory or a copy. (The wait
    is made a minute long here, so that only the close can end it, however slow the machine.)"""
    monkeypatch.setattr("engine.disaggregation.stage.HOST_POOL_WAIT_S", 60.0)
    platform, published, stager = _pool_of_two(2)
    try:
        _copying(platform, 0).complete()
        assert _wait(lambda: len(published) == 1)  # the backend holds it: the pool is full
        assert _wait(lambda: stager.held_waits == 1), "the second payload did not wait for room"
    finally:
        stager.close()
    assert not stager._thread.is_alive(), "close() did not end the wait for room"
    assert stager.stats()["fresh"] == 0, "a payload of a closed stager took fresh pinned memory"
    assert len(platform.copies) == 1 and len(published) == 1, "a payload of a closed stager was copied"


def test_a_pool_the_host_refuses_leaves_the_stager_without_one(caplog: pytest.LogCaptureFixture) -> None:
    class _Refused(_Platform):
        def pin_host_memory(self) -> bool:
            return True

    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("pin_memory"):
            raise RuntimeError("out of pinned memory")
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", empty)
        stager = KvStager(_Refused(), torch.device("cpu"), lambda key, p: None, pool_bytes=1 << 30)
    try:
        assert stager.stats()["pool_bytes"] == 0
        assert "no pinned pool of 1.00 GiB (out of pinned memory)" in caplog.text
    finally:
        stager.close()


def test_close_stops_the_thread_and_drops_what_was_not_published() -> None:
    """A copy under way when close() runs ends unpublished, like the payloads queued behind it:
    the backend is closed right after, and nothing reaches it once close() returned."""
    platform, published = _Platform(), []
    stager = KvStager(platform, torch.device("cpu"), lambda key, p: published.append(key))
    stager.publish_after(stager.gathered(*_kv(1)), "done", KvPayload(1, *_kv(1)))
    _copying(platform, 0).complete()
    assert _wait(lambda: published == ["done"])
    for key in ("first", "second"):
        copy = stager.gathered(*_kv(2))
        stager.publish_after(copy, key, KvPayload(2, *copy.sources))
    first = _copying(platform, 1)
    started = time.monotonic()
    threading.Timer(0.1, first.complete).start()  # the copy ends while close() waits for the thread
    stager.close()
    assert time.monotonic() - started < 3
    time.sleep(0.1)
    assert published == ["done"], "a copy under way when close() ran was published"
    assert not stager.busy()
    assert not any(t.name == "kv-stage" and t.is_alive() for t in threading.enumerate())


def test_the_uploader_keeps_nothing_once_the_scheduler_released_it() -> None:
    """An idle decode server holds no payload: the upload thread lets go of the last one it
    handed over (its device copy, on a GPU)."""
    up = KvUploader(None, torch.device("cpu"), threaded=True)
    try:
        payload = KvPayload(1, *_kv(3))
        gone = weakref.ref(payload.k)
        up.submit("r", payload)
        deadline = time.monotonic() + 5
        while not up.done(0.05) and time.monotonic() < deadline:
            pass  # the scheduler takes the uploaded payload (and drops it: written into the pool)
        assert not up.busy()
        up.release(1)
        del payload
        gc.collect()
        assert _wait(lambda: gone() is None), "the upload thread still holds the last payload"
    finally:
        up.close()
    assert not any(t.name == "kv-upload" and t.is_alive() for t in threading.enumerate())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copies_prompt_kv_to_pinned_host_memory_on_a_copy_stream() -> None:
    from engine.platforms import TorchCudaPlatform

    class _Cuda(TorchCudaPlatform):  # its streams and events; no plugin needed
        def is_available(self) -> bool:
            return True

        def default_attention_backend(self, available: object) -> str:
            return "triton"

    published: list[tuple[str, KvPayload]] = []
    stager = KvStager(_Cuda(), torch.device("cuda:0"), lambda key, p: published.append((key, p)))
    try:
        pool = torch.randn(4, 4096, 8, 128, device="cuda:0", dtype=torch.bfloat16)  # 4 layers of slots
        index = torch.randperm(4096, device="cuda:0")[:1000]
        want_k, want_v = pool[:, index].cpu(), (pool[:, index] * 2).cpu()
        k = pool[:, index].contiguous()  # the gather, on the current stream
        v = (pool[:, index] * 2).contiguous()
        copy = stager.gathered(k, v)
        record: dict[str, Any] = {"copy_s": None}
        stager.publish_after(copy, "a", KvPayload(0, k, v), record)
        del k, v
        pool[:, index] = 0  # a later batch's write, queued after the gather: not in the payload
        assert _wait(lambda: len(published) == 1)
        got = published[0][1]
        # Out of the pinned pool taken at start-up (a tensor of its own over it), not fresh memory.
        assert got.k.is_pinned() and got.k.device.type == "cpu" and record["copy_s"] is not None
        assert torch.equal(got.k, want_k) and torch.equal(got.v, want_v)
        assert stager.stats()["fresh"] == 0 and stager.stats()["held_bytes"] >= got.nbytes
    finally:
        stager.close()
