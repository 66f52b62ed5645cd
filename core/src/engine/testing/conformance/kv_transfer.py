"""``KvTransferConformance``: a KV transfer backend moves payloads bit for bit between a prefill
and a decode instance, refuses a layout mismatch naming it, ends every fetch by its deadline,
and forgets cancelled fetches. No engine runs: the kit builds both sides on this machine."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from engine import plugins
from engine.testing.conformance._common import KIT_SEED, derive_seed, generator

_WAIT_S = 10.0  # the longest a kit test waits for one result


def _layout(**overrides: Any) -> Any:
    from engine.disaggregation import KvLayout

    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, v_head_dim=8, dtype="torch.bfloat16", page_size=1)
    return KvLayout(**{**base, **overrides})


def _payload(seed: int, layout: Any, num_tokens: int, first_token: int = 7) -> Any:
    from engine.disaggregation import KvPayload

    dtype = getattr(torch, layout.dtype.removeprefix("torch."))
    gen = generator(seed)
    k = torch.randn(layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim, generator=gen).to(dtype)
    v = torch.randn(layout.num_layers, num_tokens, layout.num_kv_heads, layout.v_head_dim, generator=gen).to(dtype)
    return KvPayload(first_token, k, v, {"prompt_tokens": num_tokens})


# Results ``poll`` returned for other keys than the one waited for, by backend, until asked for.
_early: dict[int, dict[str, Any]] = {}


def wait_for(backend: Any, key: str, timeout_s: float = _WAIT_S) -> Any:
    """The result ``backend.poll`` gives for ``key`` (a payload or an error message)."""
    early = _early.setdefault(id(backend), {})
    if key in early:
        return early.pop(key)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for got_key, result in backend.poll(0.05):
            early[got_key] = result
        if key in early:
            return early.pop(key)
    raise AssertionError(f"no result for {key!r} within {timeout_s:g} s: every fetch must end by its deadline")


class KvTransferConformance:
    """Set ``backend_name``; ``device`` is the KV pool's device type the backend is built for."""

    backend_name: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"
    seed: ClassVar[int] = KIT_SEED
    #: seconds a payload or a fetch waits on the prefill side in the time-out tests.
    short_timeout_s: ClassVar[float] = 1.0

    def _create(self, role: str, layout: Any = None, timeout_s: float = 30.0) -> Any:
        from engine.disaggregation import KvTransferContext

        ctx = KvTransferContext(role=role, layout=layout or _layout(), host="127.0.0.1", port=0,
                                timeout_s=timeout_s, device=self.device, backend=self.backend_name)
        return plugins.create_kv_transfer_backend(self.backend_name, ctx, self.device)

    @pytest.fixture
    def pair(self) -> Iterator[tuple[Any, Any]]:
        prefill, decode = self._create("prefill"), self._create("decode")
        try:
            yield prefill, decode
        finally:
            decode.close()
            prefill.close()

    def _port(self, prefill: Any) -> int:
        port = getattr(prefill, "port", 0) or prefill.ctx.port
        assert isinstance(port, int) and port > 0, "a prefill backend built with port 0 must expose the port it chose as .port"
        return port

    def test_spec(self) -> None:
        from engine.disaggregation import KvTransferBackend

        spec = plugins.get_kv_transfer_backend(self.backend_name)
        assert spec.name == self.backend_name and self.device in spec.device_types
        backend = self._create("decode")
        try:
            assert isinstance(backend, KvTransferBackend)
        finally:
            backend.close()

    @pytest.mark.parametrize("order", ["publish_first", "fetch_first"])
    @pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float32"])
    def test_round_trip_bit_exact(self, order: str, dtype: str) -> None:
        layout = _layout(dtype=dtype)
        prefill, decode = self._create("prefill", layout), self._create("decode", layout)
        try:
            sent = _payload(derive_seed(self.seed, order, dtype), layout, num_tokens=37, first_token=11)
            if order == "publish_first":
                prefill.publish("room:a", sent)
                time.sleep(0.1)
                decode.fetch("room:a", "127.0.0.1", self._port(prefill), 10.0)
            else:
                decode.fetch("room:a", "127.0.0.1", self._port(prefill), 10.0)
                time.sleep(0.1)
                prefill.publish("room:a", sent)
            got = wait_for(decode, "room:a")
            assert not isinstance(got, str), got
            assert got.first_token == 11 and got.num_tokens == 37
            assert got.k.dtype == sent.k.dtype and got.k.shape == sent.k.shape and got.v.shape == sent.v.shape
            assert torch.equal(got.k.view(torch.uint8), sent.k.view(torch.uint8))
            assert torch.equal(got.v.view(torch.uint8), sent.v.view(torch.uint8))
            assert got.meta.get("prompt_tokens") == 37
            json.dumps(prefill.stats()), json.dumps(decode.stats())
        finally:
            decode.close()
            prefill.close()

    def test_many_keys_interleaved(self, pair: tuple[Any, Any]) -> None:
        prefill, decode = pair
        port, layout = self._port(prefill), _layout()
        sent = {f"r:{i}": _payload(derive_seed(self.seed, "many", i), layout, num_tokens=1 + i, first_token=i)
                for i in range(6)}
        for i, key in enumerate(sent):
            if i % 2:
                prefill.publish(key, sent[key])
            decode.fetch(key, "127.0.0.1", port, 10.0)
        for i, key in enumerate(sent):
            if not i % 2:
                prefill.publish(key, sent[key])
        for key, payload in sent.items():
            got = wait_for(decode, key)
            assert not isinstance(got, str), got
            assert got.first_token == payload.first_token and torch.equal(got.k, payload.k)

    def test_layout_mismatch_is_refused_naming_it(self) -> None:
        prefill = self._create("prefill", _layout(num_kv_heads=2))
        decode = self._create("decode", _layout(num_kv_heads=4))
        try:
            prefill.publish("room:x", _payload(self.seed, _layout(num_kv_heads=2), 4))
            decode.fetch("room:x", "127.0.0.1", self._port(prefill), 10.0)
            got = wait_for(decode, "room:x")
            assert isinstance(got, str) and "num_kv_heads" in got, got
        finally:
            decode.close()
            prefill.close()

    def test_mla_payload_with_empty_v(self, pair: tuple[Any, Any]) -> None:
        """An MLA pool's V lives inside its K rows: the payload's ``v`` has no elements."""
        from engine.disaggregation import KvPayload

        prefill, decode = pair
        k = torch.randn(2, 5, 1, 24, generator=generator(self.seed)).to(torch.bfloat16)
        sent_before = prefill.stats().get("bytes_sent")
        prefill.publish("room:mla", KvPayload(3, k, k.new_empty((2, 5, 1, 0))))
        decode.fetch("room:mla", "127.0.0.1", self._port(prefill), 10.0)
        got = wait_for(decode, "room:mla")
        assert not isinstance(got, str), got
        assert torch.equal(got.k, k) and tuple(got.v.shape) == (2, 5, 1, 0)
        if sent_before is not None:  # a backend that counts its bytes moved the K rows' only
            want = sent_before + k.numel() * k.element_size()
            deadline = time.monotonic() + 5.0  # the serving thread counts after its send
            while prefill.stats()["bytes_sent"] < want and time.monotonic() < deadline:
                time.sleep(0.01)
            assert prefill.stats()["bytes_sent"] == want, (
                f"bytes_sent grew by {prefill.stats()['bytes_sent'] - sent_before} for an MLA payload of "
                f"{want - sent_before} K bytes and no V")

    def test_page_size_may_differ(self) -> None:
        prefill = self._create("prefill", _layout(page_size=16))
        decode = self._create("decode", _layout(page_size=1))
        try:
            prefill.publish("room:p", _payload(self.seed, _layout(), 5))
            decode.fetch("room:p", "127.0.0.1", self._port(prefill), 10.0)
            assert not isinstance(wait_for(decode, "room:p"), str)
        finally:
            decode.close()
            prefill.close()

    def test_fetch_from_nobody_times_out(self) -> None:
        """A dead (or never started) prefill server: the fetch ends with a message by its deadline."""
        from engine.ports import free_port

        decode = self._create("decode")
        try:
            started = time.monotonic()
            decode.fetch("room:gone", "127.0.0.1", free_port(), self.short_timeout_s)
            got = wait_for(decode, "room:gone", self.short_timeout_s + 5.0)
            assert isinstance(got, str) and got, got
            assert time.monotonic() - started < self.short_timeout_s + 5.0
        finally:
            decode.close()

    def test_a_prefill_side_that_goes_away_fails_waiting_fetches_soon(self) -> None:
        """Well before the fetch's deadline: a stopped prefill server cannot answer any more."""
        prefill, decode = self._create("prefill"), self._create("decode")
        try:
            decode.fetch("room:w", "127.0.0.1", self._port(prefill), 60.0)
            time.sleep(0.5)  # connected and parked on the prefill side
            prefill.close()
            started = time.monotonic()
            got = wait_for(decode, "room:w", 15.0)
            assert isinstance(got, str) and got, got
            assert time.monotonic() - started < 5.0, "a fetch from a stopped prefill side waited for its deadline"
        finally:
            decode.close()
            prefill.close()

    def test_unpublished_key_fails_by_deadline(self) -> None:
        prefill = self._create("prefill", timeout_s=self.short_timeout_s)
        decode = self._create("decode")
        try:
            decode.fetch("room:never", "127.0.0.1", self._port(prefill), 30.0)
            got = wait_for(decode, "room:never", self.short_timeout_s + 5.0)
            assert isinstance(got, str) and got, got
        finally:
            decode.close()
            prefill.close()

    def test_cancelled_fetch_gives_no_result(self, pair: tuple[Any, Any]) -> None:
        prefill, decode = pair
        port = self._port(prefill)
        decode.fetch("room:c", "127.0.0.1", port, 10.0)
        decode.cancel("room:c")
        time.sleep(0.1)
        prefill.publish("room:c", _payload(self.seed, _layout(), 3))
        prefill.publish("room:d", _payload(self.seed, _layout(), 3))
        decode.fetch("room:d", "127.0.0.1", port, 10.0)
        assert not isinstance(wait_for(decode, "room:d"), str)
        assert all(key != "room:c" for key, _ in decode.poll(0.2))

    def test_close_is_idempotent(self) -> None:
        backend = self._create("prefill")
        backend.close()
        backend.close()
