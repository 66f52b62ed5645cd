"""A pluggable LLM serving engine in the mould of SGLang.

``from engine import Engine`` is the offline API; everything that varies
(attention, quantization, models, policies, platforms) comes from plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.version import __version__

if TYPE_CHECKING:
    from engine.entrypoints.engine import Engine


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. from a plugin) must stay cheap.
    if name == "Engine":
        from engine.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "__version__"]
