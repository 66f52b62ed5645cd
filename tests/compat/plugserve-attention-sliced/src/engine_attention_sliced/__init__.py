"""Registration of the `sliced` attention backend (import-light: the backend module loads on selection)."""

from __future__ import annotations

from engine.hookspecs import AttentionBackendSpec, hookimpl


@hookimpl
def register_attention_backends(register):  # type: ignore[no-untyped-def]
    register(AttentionBackendSpec(
        name="sliced",
        factory="engine_attention_sliced.backend:create",
        description="Attention one request row at a time, scores in float32",
        device_types=("cpu",),
    ))
