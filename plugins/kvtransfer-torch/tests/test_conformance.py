"""The torch KV transfer backend through the conformance kit (gloo on CPU; no engine)."""

from __future__ import annotations

from engine.testing import KvTransferConformance


class TestTorchKvTransfer(KvTransferConformance):
    backend_name = "torch"
