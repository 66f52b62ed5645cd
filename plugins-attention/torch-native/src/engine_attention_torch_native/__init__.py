"""The ``torch_native`` attention plugin: plain PyTorch over the paged KV pool."""

from __future__ import annotations

from engine.hookspecs import AttentionBackendSpec, hookimpl


@hookimpl
def register_attention_backends(register):  # type: ignore[no-untyped-def]
    register(AttentionBackendSpec(
        name="torch_native",
        factory="engine_attention_torch_native.backend:create",
        description="Reference attention in plain PyTorch (SDPA); runs on every device",
        device_types=("cpu", "cuda", "xpu", "npu"),
        kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),
        kv_layouts=("mha", "mla"),
    ))
