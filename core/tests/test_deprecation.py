"""The deprecation table: each entry warns with its replacement and removal release, none outlives
that release, and docs/stability.md lists every one."""

from __future__ import annotations

import pathlib
import warnings

import pytest

from engine.deprecation import DEPRECATIONS, Deprecation, warn_deprecated
from engine.version import __version__

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "stability.md"


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_removal_is_two_minor_releases_after_deprecation() -> None:
    assert Deprecation("a", "b", since="0.1").removed_in == "0.3"
    assert Deprecation("a", "b", since="1.9").removed_in == "1.11"
    with pytest.raises(ValueError, match=r"release 'one' is not MAJOR.MINOR"):
        _ = Deprecation("a", "b", since="one").removed_in


@pytest.mark.parametrize("key", sorted(DEPRECATIONS))
def test_no_deprecated_form_outlives_its_removal_release(key: str) -> None:
    """Raising the version to an entry's removal release fails here until the old form is gone."""
    entry = DEPRECATIONS[key]
    assert _minor(entry.since) <= _minor(__version__), f"{key}: deprecated since {entry.since}, after {__version__}"
    assert _minor(__version__) < _minor(entry.removed_in), (
        f"{key} is to be removed in {entry.removed_in} and this is {__version__}: remove the old form, its "
        "DEPRECATIONS entry and its row in docs/stability.md")


@pytest.mark.parametrize("key", sorted(DEPRECATIONS))
def test_warning_names_the_replacement_and_the_removal_release(key: str) -> None:
    entry = DEPRECATIONS[key]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_deprecated(key)
    (warning,) = caught
    assert warning.category is DeprecationWarning
    assert pathlib.Path(warning.filename).name != "deprecation.py", "stacklevel must point past the helper"
    message = str(warning.message)
    assert f"use {entry.replacement} instead" in message
    assert f"removed in {entry.removed_in}" in message and __version__ in message


@pytest.mark.parametrize("key", sorted(DEPRECATIONS))
def test_stability_page_lists_every_deprecation(key: str) -> None:
    text = DOC.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("|") and f"`{key}`" in line]
    assert rows, f"docs/stability.md has no table row naming `{key}`"
    entry = DEPRECATIONS[key]
    assert f"| {entry.since} |" in rows[0] and f"| {entry.removed_in} |" in rows[0], rows[0]
