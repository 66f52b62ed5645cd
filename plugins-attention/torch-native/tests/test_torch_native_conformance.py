from __future__ import annotations

from engine.testing import AttentionBackendConformance


class TestTorchNative(AttentionBackendConformance):
    backend_name = "torch_native"
