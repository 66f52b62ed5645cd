"""Error types. ``EngineError`` and its subclasses are user errors: the CLI prints
their message on one line and exits with status 2; the server maps them to 4xx."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class EngineError(Exception):
    """A problem the user can fix (bad flag, bad file, unknown plugin...)."""


class ConfigError(EngineError):
    """A configuration value is invalid."""


class PluginError(EngineError):
    """A plugin is unknown, broken, disabled or conflicting."""


class ModelLoadError(EngineError):
    """A model directory or checkpoint cannot be used."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to ``name`` (for 'did you mean' hints), or None."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean X?)`` or an empty string."""
    match = closest(name, candidates)
    return f" (did you mean {match}?)" if match else ""
