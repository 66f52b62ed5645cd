"""Whether an attention backend may run in a given configuration. The device, page-size and
KV-dtype checks live in ``engine.preflight`` (start-up and ``engine config show`` run them without
importing torch); this module keeps the import path the model runner and the conformance kit use,
and adds the check that needs the model: the KV layout (``check_kv_layout``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.errors import ConfigError
from engine.preflight import check_backend_selectable, check_kv_cache_dtype


def reads_kv_layout(spec: Any, kv_layout: str) -> bool:
    """Whether backend ``spec`` lists ``kv_layout`` (specs of hook API < 8 read "mha" only)."""
    return kv_layout in getattr(spec, "kv_layouts", ("mha",))


def check_kv_layout(spec: Any, kv_layout: str, architecture: str, readers: Iterable[str],
                    chosen_by: str = "") -> None:
    """Raises ``ConfigError`` unless backend ``spec`` reads the model's ``kv_layout``.

    Args:
        spec: the selected backend's ``AttentionBackendSpec``.
        kv_layout: the model class's ``kv_layout`` ("mha" unless it declares another).
        architecture: the checkpoint's architecture, for the message.
        readers: the enabled backends for this device that do read it, for the message.
        chosen_by: how the backend was picked when not by ``--attention`` (``"platform 'cuda' picks
            it by default"``), for the message.
    """
    if reads_kv_layout(spec, kv_layout):
        return
    names = ", ".join(readers) or "none installed"
    how = f" ({chosen_by}; choose another with --attention)" if chosen_by else ""
    raise ConfigError(f"--attention {spec.name}: backend '{spec.name}'{how} does not read the '{kv_layout}' KV layout "
                      f"of {architecture}; backends that do: {names}")


__all__ = ["check_backend_selectable", "check_kv_cache_dtype", "check_kv_layout", "reads_kv_layout"]
