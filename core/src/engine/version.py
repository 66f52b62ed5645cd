"""The engine's version, in a module of its own.

Modules inside the engine read it from here rather than from the root package: ``engine`` is the
public facade (``from engine import Engine``) at the top of the import graph, so nothing below
imports from it.
"""

from __future__ import annotations

__version__ = "0.1.0"
