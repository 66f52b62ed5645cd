"""The zmq KV transfer backend through the conformance kit (no engine)."""

from __future__ import annotations

from engine.testing import KvTransferConformance


class TestZmqKvTransfer(KvTransferConformance):
    backend_name = "zmq"
