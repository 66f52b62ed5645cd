"""What a prefill and a decode Scheduler hold once their requests are done, and their shutdown:
nothing of a finished transfer stays held while idle, and ``close_disaggregation`` ends the
transfer's threads and frees its port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import torch

from engine.disaggregation.stage import KvStager
from engine.disaggregation.transfer import KvPayload
from engine.managers.scheduler import check_no_leak
from engine.ports import free_port
from engine.testing.harness import OutputCollector, generate_greedy, make_scheduler, submit

_GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


class _DoneEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Stream:
    def wait_event(self, event: Any) -> None:
        pass


class _HostPlatform:
    """A GPU platform's stream and event calls on the CPU (every copy is done when issued): the
    prefill scheduler's staging thread path, as on a GPU with host payloads."""

    def create_stream(self) -> _Stream:
        return _Stream()

    def stream_context(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def create_event(self) -> _DoneEvent:
        return _DoneEvent()

    def set_device(self, device: Any) -> None:
        pass

    def pin_host_memory(self) -> bool:
        return False


class _PendingEvent:
    """A device event whose write has not run yet (``done`` flips it)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _kv_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kv-") and t.is_alive()}


def _pair_run(prefill: Any, decode: Any, prompt: list[int], rid: str, timeout_s: float = 30.0) -> list[int]:
    port = prefill.kv_transfer.port
    submit(prefill, prompt, _GREEDY, rid=rid, bootstrap_room=5)
    submit(decode, prompt, _GREEDY, rid=rid, bootstrap_room=5, bootstrap_host="127.0.0.1", bootstrap_port=port)
    col = OutputCollector()
    deadline = time.monotonic() + timeout_s
    while rid not in col.finish and time.monotonic() < deadline:
        prefill.step()
        prefill.take_outputs()
        decode.step()
        col.collect(decode)
    assert rid in col.finish, f"{rid} did not finish in {timeout_s} s"
    return col.ids[rid]


def test_an_idle_pair_holds_nothing_and_closes_cleanly(llama_ckpt: str) -> None:
    before = _kv_threads()
    bootstrap = free_port()
    prefill = make_scheduler(llama_ckpt, disaggregation_mode="prefill", disaggregation_bootstrap_port=bootstrap)
    decode = make_scheduler(llama_ckpt, disaggregation_mode="decode", disaggregation_timeout_s=60.0)
    try:
        prompt = [7, 20, 5, 9, 11, 3, 8]
        (want,) = generate_greedy(decode, [prompt], _GREEDY["max_new_tokens"], ignore_eos=True)
        assert _pair_run(prefill, decode, prompt, "idle-0") == want
        assert not decode.has_work() and not prefill.has_work()
        # The prefill side's staging thread (GPU pools with host payloads) publishes the same KV.
        prefill.disagg_stager = KvStager(_HostPlatform(), torch.device("cpu"), prefill.kv_transfer.publish)
        assert _pair_run(prefill, decode, prompt, "staged-0") == want
        assert prefill.stats()["disaggregation"]["recent"][-1]["copy_s"] is not None
        assert _wait(lambda: not prefill.disagg_stager.busy())
        assert prefill.stats()["disaggregation"]["staging"]["copying"] == 0

        # A GPU write's payload stays until its event has passed (on the CPU the write is done
        # at once, so the pending event is set up here): the loop keeps stepping until then,
        # and the step after it lets the payload go without any new request.
        uploader = decode.disagg_uploader
        uploader._held += 1  # as after an upload
        event = _PendingEvent()
        decode._disagg_writing.append((event, KvPayload(0, torch.zeros(2, 1, 1, 1), torch.zeros(2, 1, 1, 1))))
        assert decode.has_work(), "a payload waiting for its write's event does not keep the loop stepping"
        decode.step()
        assert decode._disagg_writing and decode.has_work()
        event.done = True
        decode.step()
        assert decode._disagg_writing == [] and uploader._held == 0 and not decode.has_work()
        decode.flush_cache()
        prefill.flush_cache()
        check_no_leak(decode)
        check_no_leak(prefill)

        # Shutdown: threads end, the bootstrap port is free again, a second close is a no-op.
        started = time.monotonic()
        prefill.close_disaggregation()
        decode.close_disaggregation()
        prefill.close_disaggregation()
        assert time.monotonic() - started < 10
        assert _wait(lambda: _kv_threads() <= before), f"still running: {_kv_threads() - before}"
        with socket.socket() as sock:  # as zmq binds: a closed connection's TIME_WAIT is no obstacle, a listener is
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", bootstrap))
            sock.listen()
        assert prefill.kv_transfer is None and not decode.has_work()
        # Closed, each serves requests whole (the router sends none any more).
        (again,) = generate_greedy(decode, [prompt], _GREEDY["max_new_tokens"], ignore_eos=True)
        assert again == want
    finally:
        prefill.close_disaggregation()
        decode.close_disaggregation()


def _wait(cond: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(cond())
