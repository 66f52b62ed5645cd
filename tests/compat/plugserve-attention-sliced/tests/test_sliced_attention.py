"""The conformance kit against the `sliced` backend."""

from __future__ import annotations

from engine.testing import AttentionBackendConformance


class TestSlicedAttention(AttentionBackendConformance):
    backend_name = "sliced"
    page_sizes = (1, 4)
    num_heads = 4
    num_kv_heads = 2
    head_dim = 16
