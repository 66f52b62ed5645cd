"""Whether an attention backend may run in a given configuration. The checks live in
``engine.preflight`` (start-up and ``engine config show`` run them without importing torch);
this module keeps the import path the model runner and the conformance kit use."""

from __future__ import annotations

from engine.preflight import check_backend_selectable, check_kv_cache_dtype

__all__ = ["check_backend_selectable", "check_kv_cache_dtype"]
