"""Backends are a plugin kind of the language's own: a distribution registers a ``Backend``
subclass (or a factory returning one) under the entry-point group ``engine_lang.backends``::

    [project.entry-points."engine_lang.backends"]
    mycloud = "engine_lang_mycloud:MyCloudBackend"

``list_backends()`` names what is installed without importing it; ``load_backend(name)`` imports
one, and ``connect(name, **kwargs)`` creates it. The three built-in backends register the same way.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from engine_lang.backends.base import (
    Backend,
    BackendError,
    GenOutput,
    GenRequest,
    RequestAborted,
    ScoreOutput,
    ScoreRequest,
    UnsupportedOperation,
)

GROUP = "engine_lang.backends"


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def list_backends() -> dict[str, str]:
    """Installed backends: name -> ``module:attr`` (nothing is imported)."""
    return {name: ep.value for name, ep in sorted(_entry_points().items())}


def load_backend(name: str) -> Any:
    """The class (or factory) registered as ``name``."""
    eps = _entry_points()
    if name not in eps:
        raise ValueError(f"unknown frontend-language backend {name!r}; installed: {', '.join(sorted(eps)) or 'none'}")
    try:
        return eps[name].load()
    except Exception as exc:
        raise ImportError(f"frontend-language backend {name!r} ({eps[name].value}) failed to import: {exc}") from exc


def connect(name: str, *args: Any, **kwargs: Any) -> Backend:
    """Creates the backend registered as ``name``: ``connect("runtime", "http://127.0.0.1:30000")``."""
    backend = load_backend(name)(*args, **kwargs)
    if not isinstance(backend, Backend):
        raise TypeError(f"frontend-language backend {name!r} made {type(backend).__name__}, not an engine_lang Backend")
    return backend


__all__ = ["GROUP", "Backend", "BackendError", "GenOutput", "GenRequest", "RequestAborted", "ScoreOutput",
           "ScoreRequest", "UnsupportedOperation", "connect", "list_backends", "load_backend"]
