"""Whether an attention backend may run in a given configuration (one check, used by the model
runner when it creates the backend and by the conformance kit)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.hookspecs import AttentionBackendSpec


def check_backend_selectable(spec: AttentionBackendSpec, device_type: str, page_size: int,
                             kv_cache_dtype: str = "auto") -> None:
    """Raises ``ConfigError`` unless ``spec`` declares ``device_type`` and accepts ``page_size``
    and ``kv_cache_dtype``.

    Args:
        spec: the backend's registered spec (``device_types`` defaults to ``("cuda",)``).
        device_type: ``Platform.device_type`` of the selected platform (``torch.device.type``).
        page_size: ``--page-size``.
        kv_cache_dtype: ``--kv-cache-dtype`` (``kv_cache_dtypes`` defaults to ``("auto",)``).
    """
    if device_type not in spec.device_types:
        raise ConfigError(
            f"--attention: backend '{spec.name}' does not run on {device_type} "
            f"(it supports: {', '.join(spec.device_types)})"
        )
    if spec.page_sizes and page_size not in spec.page_sizes:
        raise ConfigError(f"--page-size: invalid value {page_size} for attention backend '{spec.name}'; "
                          f"accepted: {', '.join(map(str, spec.page_sizes))}")
    check_kv_cache_dtype(spec, kv_cache_dtype)


def check_kv_cache_dtype(spec: AttentionBackendSpec, kv_cache_dtype: str) -> None:
    """Raises ``ConfigError`` unless the backend declares ``kv_cache_dtype`` in its spec."""
    accepted = getattr(spec, "kv_cache_dtypes", ("auto",))
    if kv_cache_dtype not in accepted:
        raise ConfigError(f"--kv-cache-dtype: attention backend '{spec.name}' does not support {kv_cache_dtype!r} "
                          f"(it supports: {', '.join(accepted)})")
