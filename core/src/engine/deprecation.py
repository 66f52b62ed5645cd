"""Deprecated forms of the public plugin API, and the warning each one gives.

A public name or call form that changes keeps working, in its old form, for at least one
minor release after the one that deprecated it (docs/stability.md). Using it emits a
``DeprecationWarning`` that names the replacement and the release that removes the old form.
Every deprecation is an entry of ``DEPRECATIONS``, so the list is data: docs/stability.md
shows the same table, and a test fails when an entry outlives its removal release.

This module imports nothing but the standard library and ``engine.version``: layers, kits and
hook machinery at any depth may call ``warn_deprecated``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from engine.version import __version__


def _minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a release string such as ``"0.1.0"`` or ``"0.3"``."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"release {version!r} is not MAJOR.MINOR[.PATCH]") from None


@dataclass(frozen=True)
class Deprecation:
    """One deprecated form and what replaces it."""

    #: the old form as a plugin writes it, e.g. ``"SiluAndMul(act)"``.
    old: str
    #: what to write instead; the warning quotes it.
    replacement: str
    #: the release (``MAJOR.MINOR``) whose API no longer documents the old form.
    since: str
    #: one sentence on what the old form does now, if more than "the same as the replacement".
    note: str = ""

    @property
    def removed_in(self) -> str:
        """The first release without the old form: two minors after ``since``, so the old form
        works throughout the whole next minor release."""
        major, minor = _minor(self.since)
        return f"{major}.{minor + 2}"

    def message(self) -> str:
        note = f" {self.note}" if self.note else ""
        return (f"{self.old} is deprecated since plugserve-core {self.since} and will be removed in "
                f"{self.removed_in} (this is {__version__}); use {self.replacement} instead.{note} "
                "See docs/stability.md.")


#: Every current deprecation, keyed by the id call sites pass to ``warn_deprecated``.
DEPRECATIONS: dict[str, Deprecation] = {
    "SiluAndMul(act)": Deprecation(
        old="SiluAndMul(act) (engine.layers.SiluAndMul with an activation name)",
        replacement="engine.layers.get_act_and_mul(act) (SiluAndMul() where act is SiLU)",
        since="0.1",
        note="The old form builds what get_act_and_mul(act) builds (GeluAndMul for the GELU names).",
    ),
    "engine.testing.conformance.random": Deprecation(
        old="engine.testing.conformance.random (the module the attention kit drew its batches from)",
        replacement="the kit class's `seed` attribute (class TestMine(AttentionBackendConformance): seed = 1234)",
        since="0.1",
        note="The kit draws every batch from a generator seeded by `seed` and the test's parameters; "
             "replacing this attribute changes nothing the kit draws.",
    ),
    "engine.testing.conformance.torch": Deprecation(
        old="engine.testing.conformance.torch (seeding the kit through torch's global generator)",
        replacement="the kit class's `seed` attribute (class TestMine(AttentionBackendConformance): seed = 1234)",
        since="0.1",
        note="The kit draws from its own seeded generators, not torch's global one.",
    ),
}


def warn_deprecated(key: str, stacklevel: int = 2) -> None:
    """Emits the ``DeprecationWarning`` of ``DEPRECATIONS[key]``.

    Args:
        key: the entry's id in ``DEPRECATIONS``.
        stacklevel: as for ``warnings.warn``, counted from the caller of this function (2: the
            warning points at whoever called the function that calls ``warn_deprecated``).
    """
    warnings.warn(DEPRECATIONS[key].message(), DeprecationWarning, stacklevel=stacklevel + 1)
